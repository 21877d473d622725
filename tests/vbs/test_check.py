"""workbench.vbs.check: the first-batch check compares like torch.testing.assert_close, one sample's
outputs at a time, with a few temporaries of that size (what the executor counts for it)."""

import pytest
import torch

from workbench.measure import AllocatorMeter
from workbench.vbs.check import COMPARE_TEMPORARIES, close, mismatch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_close_agrees_with_assert_close(dtype):
    torch.manual_seed(0)
    want = torch.randn(1, 1000).to(dtype)
    want[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0])
    for got in (want.clone(), want + 1e-7, want * (1 + 1e-3), want + 1.0):
        try:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
            agrees = True
        except AssertionError:
            agrees = False
        assert close(got, want, 1e-3, 1e-5) == agrees
    nan = want.clone()
    nan[0, 5] = float("nan")
    assert not close(nan, nan.clone(), 1e-3, 1e-5)
    assert not close(want[:, :10], want, 1e-3, 1e-5) and not close(want.double(), want.double() + 1, 0, 0)
    assert close(torch.arange(4), torch.arange(4), 0, 0) and not close(torch.arange(4), torch.arange(4) + 1, 0, 0)


def test_a_mismatch_is_reported_and_the_temporaries_are_few():
    want = torch.randn(1, 64, 32, 32)
    assert mismatch(want.clone(), want, None, None) == ""
    assert "Mismatched elements" in mismatch(want + 1, want, None, None)
    got = want.clone()
    with AllocatorMeter() as meter:
        assert close(got, want, 1.3e-6, 1e-5)
    assert meter.peak_bytes <= COMPARE_TEMPORARIES * want.numel() * want.element_size()
