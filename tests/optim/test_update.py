"""The torch.compile'd update paths against the eager ones, bit for bit (Lewandowski & Kosson, 3.1, 3.2).

Each test compiles once (C++ codegen on CPU, seconds): the fused flat step with every option that
changes the kernel (byte planes, stochastic rounding and master rounding from the in-kernel hash,
bf16 moments, amsgrad, maximize, a loss scale unscaled in the kernel), and the per-parameter step
with dynamic shapes that ``step_in_backward`` runs (also with Triton on CUDA where a GPU is present).
"""

import copy

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.optim import PackedAdamW, step_in_backward

BF16 = torch.bfloat16
SHAPES = [(37, 5), (64,), (3, 3, 3), (1,)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(BF16)) for s in SHAPES]


def _grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(BF16) for s in SHAPES] for _ in range(steps)]


def _snapshot(opt, params):
    return [(p.detach().view(torch.int16).clone(), {k: v.clone() for k, v in opt.state[p].items()
                                                    if torch.is_tensor(v)}) for p in params]


def test_compiled_fused_step_with_every_option_equals_eager():
    # every option that changes the kernel, including the loss scale torch.amp.GradScaler hands the
    # step (unscaled in fp32 inside the update) and amsgrad's third state
    grads = _grads(4)
    out = []
    for compile_ in (False, True):
        params = _params()
        opt = PackedAdamW(params, lr=1e-2, extra_bits=7, stochastic_rounding=True, master_rounding="stochastic",
                          state_dtype=BF16, fused=True, compile=compile_, seed=9, amsgrad=True, maximize=True)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone() * 1024
            opt.grad_scale = torch.tensor(1024.0)  # what GradScaler.step sets (torch.amp's protocol)
            opt.step()
            opt.zero_grad()
        out.append(_snapshot(opt, params))
    assert out[1][0][1]["extra"].dtype == torch.uint8  # 7 bits + the SR flag: one byte plane
    assert "max_exp_avg_sq" in out[1][0][1]
    for (a, sa), (b, sb) in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_compiled_step_in_backward_equals_eager_normal_step(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 33), nn.ReLU(), nn.Linear(33, 3)).to(device, BF16)
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 12, generator=g).to(device, BF16), torch.randint(0, 3, (8,), generator=g).to(device))
               for _ in range(3)]
    normal = PackedAdamW(model.parameters(), lr=1e-2, extra_bits=16, master_rounding="stochastic", seed=2)
    inside = PackedAdamW(other.parameters(), lr=1e-2, extra_bits=16, master_rounding="stochastic", seed=2,
                         compile=True)
    handle = step_in_backward(other, inside)
    for x, y in batches:
        nn.functional.cross_entropy(model(x).float(), y).backward()
        normal.step()
        normal.zero_grad()
        nn.functional.cross_entropy(other(x).float(), y).backward()
    handle.remove()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
        torch.testing.assert_close(inside.master_weight(q), normal.master_weight(p), rtol=0, atol=0)
