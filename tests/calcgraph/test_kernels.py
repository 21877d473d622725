"""A plan's fake tensors take each op's C++ meta kernel over its Python decomposition (`calcgraph.kernels`, issue 45):
the same traces as torch's own `FakeTensorMode`, except BatchNorm's saved statistics under autocast, where they
now agree with the kernel that runs (checked against real runs, not against either fake path)."""

import functools

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from workbench.calcgraph import tracker, training_program
from workbench.calcgraph.plan import _user_rows
from workbench.calcgraph.tracker import _trace
from workbench.calcgraph.zoo import ZOO
from workbench.optim import PackedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")
BATCH_NORM = "native_batch_norm.default"


def _zoo_program(case, size: int, annotate, device: str = "cpu") -> None:
    training_program(case.build, case.shape, size, loss=case.loss, optimizer=case.optimizer,
                     input_dtype=case.input_dtype, annotate=annotate, device=device,
                     make_batch=None if case.sample is None else _user_rows(case.sample.to(device)))


def _traced(program, mode=None, monkeypatch=None, device: str = "cpu"):
    if mode is not None:
        monkeypatch.setattr(tracker, "_fake_mode", lambda _device: mode)
    return _trace(program, device=torch.device(device))


def _cnn(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(1), nn.Linear(8 * 6 * 6, 5)).to(dtype)


PROGRAMS = {
    "cnn fp32": functools.partial(training_program, _cnn, (3, 6, 6), 3),
    "cnn autocast bf16": functools.partial(training_program, _cnn, (3, 6, 6), 3, autocast=torch.bfloat16),
    "cnn bf16 weights": functools.partial(training_program, functools.partial(_cnn, torch.bfloat16), (3, 6, 6), 3,
                                          input_dtype=torch.bfloat16,
                                          optimizer=lambda params: PackedAdamW(params, extra_bits=8, seed=0)),
    **{f"zoo {name}": functools.partial(_zoo_program, case, 3) for name, case in ZOO.items()},
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_trace_equals_torchs_fake_tensors_but_for_batchnorm_statistics_under_autocast(name, monkeypatch):
    program = lambda annotate: PROGRAMS[name](annotate=annotate)  # noqa: E731
    ours = _traced(program)
    torchs = _traced(program, FakeTensorMode, monkeypatch)
    assert ours.signature == torchs.signature, name
    differ = np.nonzero(ours.sizes != torchs.sizes)[0]
    calls = {ours.keys[i][0] for i in range(len(ours.keys)) if ours.keys[i] != torchs.keys[i]}
    if name == "cnn autocast bf16":  # each BatchNorm's two saved statistics of 8 channels, in each of two steps
        assert {ours.info[i]["op"] for i in differ} == {BATCH_NORM} and len(differ) == 2 * 2 * 2
        assert set(ours.sizes[differ]) == {32} and set(torchs.sizes[differ]) == {16}
        assert calls == {"native_batch_norm_backward.default"}  # which takes them
    else:
        assert len(differ) == 0, [(ours.info[i]["op"], ours.sizes[i], torchs.sizes[i]) for i in differ]
        assert not calls


@pytest.mark.parametrize("name", ["cnn fp32", "cnn autocast bf16", "cnn bf16 weights"])
def test_batchnorms_tensors_are_the_real_kernels(name):
    program = lambda annotate: PROGRAMS[name](annotate=annotate)  # noqa: E731
    fake, real = _traced(program), _trace(program, fake=False)

    def made_by_batch_norm(trace) -> list[int]:
        return [int(trace.sizes[i]) for i, info in enumerate(trace.info) if info["op"] == BATCH_NORM]
    assert made_by_batch_norm(fake) == made_by_batch_norm(real) != []


def test_a_trace_leaves_no_entry_in_torchs_dispatch_cache():
    _traced(lambda annotate: PROGRAMS["cnn autocast bf16"](annotate=annotate))
    assert len(FakeTensorMode.cache) == 0


def test_a_cuda_program_is_traced_on_torchs_own_path_here(monkeypatch):
    assert tracker._fake_mode(torch.device("cuda")) is FakeTensorMode
    assert tracker._fake_mode(torch.device("cpu")) is tracker.PlanFakeTensorMode


@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in ZOO if "lstm" not in n and n != "gru"])  # cuDNN's RNNs: `Unplannable`
def test_on_cuda_the_meta_kernels_give_torchs_traces(name, monkeypatch):
    """Whether a CUDA program may take the C++ meta kernels too (`tracker._fake_mode`): equal traces both ways."""
    program = functools.partial(_zoo_program, ZOO[name], 3, device="cuda")
    ours = _traced(program, tracker.PlanFakeTensorMode, monkeypatch, device="cuda")
    torchs = _traced(program, FakeTensorMode, monkeypatch, device="cuda")
    assert ours.signature == torchs.signature, name
    np.testing.assert_array_equal(ours.sizes, torchs.sizes, err_msg=name)
