"""Section 4.1's limits measured, and the bytes of each optimizer option (Lewandowski & Kosson, 3.1, 4.1):
``workbench.experiments.packed_bit_optimizers.fused_step_limits`` and the analytic sizes it is checked against.
(The fp16 loss-scaling demo, ``loss_scaling_curves``, is tested in test_scaling.py.)"""

import pytest
import torch

from workbench.experiments.packed_bit_optimizers import (
    accumulation_memory,
    analytic_bytes_per_param,
    bytes_per_param_table,
    make_optimizer,
    parse_format,
)
from workbench.models import MLP


def _mlp():
    return MLP(sizes=(64, 96, 96, 10), activation="relu")


def _batches(n, batch=8, width=64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, width, generator=g), torch.randint(10, (batch,), generator=g)) for _ in range(n)]


def test_amsgrad_costs_one_more_state_in_the_analytic_count():
    for name, state in (("bf16+8", 4), ("fp16+13 SR", 4), ("fp32", 4), ("bf16", 2)):
        fmt = parse_format(name)
        assert (analytic_bytes_per_param(fmt, optimizer="adamw", amsgrad=True)
                - analytic_bytes_per_param(fmt, optimizer="adamw")) == state
    fmt = parse_format("bf16+8")
    # in backward the gradients are gone, unless accumulation keeps them (2 bytes for bf16)
    assert (analytic_bytes_per_param(fmt, in_backward=True, accumulate=4)
            - analytic_bytes_per_param(fmt, in_backward=True)) == 2
    with pytest.raises(ValueError, match="amsgrad=True applies to optimizer='adamw' only"):
        make_optimizer([torch.nn.Parameter(torch.zeros(2))], parse_format("fp32"), lr=0.1, amsgrad=True)


def test_bytes_per_param_table_measures_what_the_analytic_count_says():
    df = bytes_per_param_table(_mlp, _batches(1)[0])
    assert len(df) == 9
    params, tensors = int(df["params"].iloc[0]), 6
    for _, row in df.iterrows():
        # packed extra bits are padded to 32 values per tensor; torch keeps a step scalar per tensor
        assert 0 <= row["bytes_per_param"] - row["analytic_bytes_per_param"] <= tensors * 64 / params
    by = df.set_index(["format", "optimizer"])["state_bytes_per_param"]
    for fmt in ("fp32", "bf16+8", "fp16+13 SR"):
        assert by[(fmt, "adamw+amsgrad")] - by[(fmt, "adamw")] == 4.0  # the running max, fp32
    with pytest.raises(ValueError, match="optimizer 'sgd\\+amsgrad': allowed"):
        bytes_per_param_table(_mlp, _batches(1)[0], optimizers=["sgd+amsgrad"])


def test_accumulation_keeps_every_gradient_between_micro_batches():
    df = accumulation_memory(_mlp, _batches(6), accumulate=3)
    one, acc, ordinary = (df.iloc[i] for i in range(3))
    assert (one["mode"], one["accumulate"], acc["accumulate"], ordinary["mode"]) == (
        "step in backward", 1, 3, "ordinary step")
    grads = int(one["gradient_bytes"])
    assert grads == sum(p.numel() for p in _mlp().parameters()) * 2  # bf16
    # what accumulation keeps: nothing at accumulate=1 in backward, every gradient at accumulate=3
    assert one["held_gradient_bytes"] == 0
    assert acc["held_gradient_bytes"] == grads == ordinary["held_gradient_bytes"]
    # the peak can only grow by what is kept, and at most by every gradient
    assert 0 <= acc["extra_vs_accumulate_1"] <= grads
    assert acc["optimizer_steps"] == 2 and one["optimizer_steps"] == 6
    with pytest.raises(ValueError, match="expected 2 \\* accumulate = 6"):
        accumulation_memory(_mlp, _batches(4), accumulate=3)
    with pytest.raises(ValueError, match="accumulate=1: allowed integers >= 2"):
        accumulation_memory(_mlp, _batches(2), accumulate=1)
