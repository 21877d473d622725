"""The packed optimizers on CUDA (Lewandowski & Kosson, 3.1): the hand-written Triton step (fused and per
parameter) and the torch.compile'd one against the eager CPU step bit for bit, and parity with torch's fused
CUDA AdamW. Skipped without a GPU.
(The compiled step inside backward on CUDA is in tests/optim/test_update.py.)"""

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.optim import PackedAdamW

pytestmark = requires_cuda

BF16, FP16 = torch.bfloat16, torch.float16
SHAPES = [(37, 5), (64,), (3, 3, 3), (1,), (4099,)]


def _params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]


def _grads(dtype, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in SHAPES] for _ in range(steps)]


def _run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.to(p.device, p.dtype)
        opt.step()
        opt.zero_grad()


# byte planes (8, 16 stored bits), dense words (9 bits: 7 + SR flag; 12 bits), every random option, bf16 moments
FORMATS = [
    (BF16, 8, dict()),
    (BF16, 16, dict()),
    (FP16, 8, dict(stochastic_rounding=True)),
    (BF16, 7, dict(stochastic_rounding=True, master_rounding="stochastic", state_dtype=BF16)),
    (BF16, 12, dict(amsgrad=True, maximize=True)),
]
# the CUDA steps a user gets: the hand-written Triton kernel (compile=None), fused and per parameter, and the
# torch.compile'd step (compile=True)
BACKENDS = [(True, None, "triton_kernel"), (False, None, "triton_kernel"), (True, True, "compiled")]


@pytest.mark.parametrize(("fused", "compile_", "backend"), BACKENDS, ids=["kernel fused", "kernel per parameter",
                                                                           "compiled fused"])
@pytest.mark.parametrize(("dtype", "k", "kw"), FORMATS)
def test_cuda_steps_equal_the_eager_cpu_step(dtype, k, kw, fused, compile_, backend):
    grads = _grads(dtype, 3)
    out = []
    for device, comp in (("cpu", False), ("cuda", compile_)):
        params = _params(dtype, device)
        opt = PackedAdamW(params, lr=1e-2, weight_decay=0.1, extra_bits=k, fused=fused, compile=comp, seed=3, **kw)
        if device == "cuda":
            assert opt.step_backend() == backend
        _run(opt, params, grads)
        out.append([(p.detach().cpu().view(torch.int16), {n: t.cpu() for n, t in opt.state[p].items()
                                                           if torch.is_tensor(t)}) for p in params])
    for (a, sa), (b, sb) in zip(*out, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        for name in sa:
            torch.testing.assert_close(sb[name], sa[name], rtol=0, atol=0)


def test_bf16_plus_16_tracks_torch_fused_cuda_adamw():
    params = _params(BF16, "cuda")
    ref = [nn.Parameter(p.detach().float()) for p in params]
    grads = _grads(BF16, 50)
    opt = PackedAdamW(params, lr=1e-2, weight_decay=0.1, extra_bits=16, fused=True, compile=True)
    _run(opt, params, grads)
    _run(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True), ref, grads)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(opt.master_weight(p), r.detach(), rtol=1e-5, atol=1e-6)
