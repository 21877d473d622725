"""The step inside backward never raises a step's peak memory (Lewandowski & Kosson 3.2; issue 33 item 2).

With the step in backward each gradient is freed as soon as its parameter is updated, so at every moment
of backward the live tensors are a subset of an ordinary step's, as long as the per-parameter update
allocates nothing: the hand-written kernels (C++ on CPU for the formats it takes, Triton on CUDA for every
format) update in place. Measured on a model whose ordinary peak is in backward, by the project's
``MemoryMeter`` and, independently, the allocator's own events (``AllocatorMeter``) on CPU and
``max_memory_allocated`` on CUDA. The eager update, where no kernel takes the update, allocates per chunk
(bounded: ``update.CHUNK`` values at most 64 bytes each on CPU).
"""

import pytest
import torch
from torch import nn

from tests.conftest import requires_cuda
from workbench.measure import MemoryMeter
from workbench.optim import PackedAdamW, step_in_backward
from workbench.optim.packing import packed_words
from workbench.optim.update import CHUNK, adam_math, chunked_update


def _setup(device, dtype, *, in_backward, width, batch, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10)).to(device, dtype)
    opt = PackedAdamW(model.parameters(), lr=1e-3, **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=g).to(device, dtype)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    handle = step_in_backward(model, opt) if in_backward else None

    def step(with_update=True):
        nn.functional.cross_entropy(model(x).float(), y).backward()
        if handle is None and with_update:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on: the steady state is measured
    return step, opt


def _peaks(device, dtype, *, width, batch, **options):
    """Peak of one steady-state step: ordinary, its forward and backward alone, and with the step in backward."""
    out = {}
    for name, sib, update in (("ordinary", False, True), ("backward only", False, False), ("in backward", True, True)):
        step, opt = _setup(device, dtype, in_backward=sib, width=width, batch=batch, **options)
        with MemoryMeter(device, allocator=True) as meter:
            step(update)
        out[name] = (meter.peak_bytes, meter.allocator_peak_bytes)
        if name == "in backward":
            out["backend"] = opt.step_backend(per_parameter=True)
        if name == "backward only":
            opt.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("options", [dict(extra_bits=8), dict(extra_bits=7, stochastic_rounding=True,
                                                              state_dtype=torch.bfloat16)], ids=["bf16+8", "bf16+7 SR"])
def test_step_in_backward_never_raises_the_peak_on_cpu(one_thread, options):
    peaks = _peaks("cpu", torch.bfloat16, width=256, batch=512, **options)
    assert peaks["backend"] == "cpu_kernel"
    ordinary, backward_only, inside = peaks["ordinary"], peaks["backward only"], peaks["in backward"]
    assert backward_only == ordinary  # the ordinary step's peak is in backward (the step adds nothing above it)
    for meter in (0, 1):  # MemoryMeter's tensors, the c10 allocator's events
        assert inside[meter] <= ordinary[meter], (meter, inside, ordinary)


def test_the_eager_fallback_allocates_at_most_64_bytes_per_chunk_value(one_thread):
    # dense words with every random option and amsgrad: the eager update (no CPU kernel takes them) in chunks
    n = 3 * CHUNK + 100
    half, grad = torch.randn(n).half(), (torch.randn(n) * 1e-3).half()
    words = torch.zeros(packed_words(n, 14), dtype=torch.int32)
    states = [torch.zeros(n) for _ in range(3)]
    coef = torch.tensor([0.99, 0.01, 0.1, 0.999, 0.001, 0.03, 1e-8, 0.01, 0.9])
    with MemoryMeter("cpu", allocator=True) as meter:
        chunked_update(half, grad, words, states, coef, 5, bits=14, math_fn=adam_math, extra_bits=13,
                       stochastic_rounding=True, master_rounding="stochastic",
                       options={"decoupled": True, "amsgrad": True, "maximize": True})
    assert 0 < meter.peak_bytes <= 64 * CHUNK and meter.allocator_peak_bytes <= 64 * CHUNK + 4096


@requires_cuda
@pytest.mark.parametrize("options", [dict(extra_bits=8), dict(extra_bits=12),
                                     dict(extra_bits=13, stochastic_rounding=True, master_rounding="stochastic")],
                         ids=["bf16+8", "bf16+12", "fp16+13 SR"])
def test_step_in_backward_never_raises_the_peak_on_cuda(options):
    dtype = torch.float16 if options["extra_bits"] == 13 else torch.bfloat16
    peaks = _peaks("cuda", dtype, width=2048, batch=8192, **options)
    assert peaks["backend"] == "triton_kernel"
    ordinary, backward_only, inside = peaks["ordinary"], peaks["backward only"], peaks["in backward"]
    # max_memory_allocated: the ordinary peak is in backward (the step adds at most its coefficients' block)
    assert ordinary[0] - backward_only[0] <= 512
    # at most the 9 coefficients of the step (one 512-byte block of the caching allocator), made at the first
    # parameter's update
    assert inside[0] <= ordinary[0] + 512, (inside, ordinary)
