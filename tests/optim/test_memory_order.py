"""The order in which a parameter's values meet the packed step (`workbench.optim.layout`): a contiguous tensor's
logical order, a dense channels_last one's memory order, and no view made where a 1-D tensor is that order already
(an op each, which a plan's fake tensors pay tens of microseconds for)."""

import pytest
import torch

from workbench.optim.layout import grad_in_order, memory_order


def test_a_1d_contiguous_tensor_is_its_own_memory_order():
    t = torch.arange(6.0)
    assert memory_order(t) is t


@pytest.mark.parametrize("make", [lambda: torch.arange(24.0).reshape(2, 3, 4),
                                  lambda: torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
                                  lambda: torch.arange(12.0).reshape(3, 4).t()],
                         ids=["contiguous 3-d", "channels last", "transposed"])
def test_a_dense_tensor_is_viewed_in_memory_order(make):
    t = make()
    flat = memory_order(t)
    assert flat.dim() == 1 and flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    torch.testing.assert_close(flat, torch.as_strided(t, (t.numel(),), (1,), t.storage_offset()))
    flat.mul_(2)  # a view: writes reach the tensor
    torch.testing.assert_close(flat, torch.as_strided(t, (t.numel(),), (1,), t.storage_offset()))


def test_a_gapped_tensor_is_refused():
    with pytest.raises(ValueError, match="gaps or overlaps"):
        memory_order(torch.arange(12.0).reshape(3, 4)[:, ::2])


def test_a_gradient_laid_out_otherwise_is_copied_into_the_parameters_order():
    p = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    grad = torch.randn(2, 3, 4, 5)  # contiguous: not p's strides
    flat = grad_in_order(grad, p)
    torch.testing.assert_close(flat, memory_order(grad.contiguous(memory_format=torch.channels_last)))
    bias_grad = torch.randn(7)
    assert grad_in_order(bias_grad, torch.zeros(7)) is bias_grad
