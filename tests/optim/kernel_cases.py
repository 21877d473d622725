"""Inputs shared by the packed-step kernels' tests (``test_cpu_kernel``, ``test_triton_kernel``).

Every byte-plane format, every width in dense words (``ALL_FORMATS``), Adam(W) and SGD variants, ordinary
values with special ones mixed in (zeros,
subnormals, infinities, NaNs, the largest finite values, rounding ties) or random bit patterns everywhere.
"""

import math

import torch

from workbench.optim.formats import storage_bits
from workbench.optim.packing import pack
from workbench.optim.update import adam_math, sgd_math

BF16, FP16 = torch.bfloat16, torch.float16
# (16-bit dtype, extra bits, stochastic rounding): every format the kernel takes
FORMATS = [(BF16, 8, False), (BF16, 16, False), (BF16, 7, True), (BF16, 15, True), (FP16, 8, False),
           (FP16, 7, True)]
NO_PLANES = [(BF16, 0, False), (FP16, 0, False)]  # k = 0: the 16-bit value alone (the CPU kernel takes them)
# every format a packed optimizer takes: k = 0..16 (bf16) or 0..13 (fp16), with and without stochastic rounding
ALL_FORMATS = [(dtype, k, sr) for dtype, full in ((BF16, 16), (FP16, 13)) for sr in (False, True)
               for k in range(full + 1)]
MATHS = [
    (adam_math, {"decoupled": True}),
    (adam_math, {"decoupled": False}),
    (sgd_math, {"momentum": True, "nesterov": True, "first": False}),
    (sgd_math, {"momentum": True, "nesterov": False, "first": True}),
    (sgd_math, {"momentum": False, "nesterov": False, "first": False}),
]
KEY = -123456789


def fmt_id(fmt):
    dtype, k, sr = fmt
    return f"{'bf16' if dtype == BF16 else 'fp16'}+{k}{'SR' if sr else ''}"


def coef_for(math_fn, step=3):
    if math_fn is sgd_math:
        return torch.tensor([1e-2, 1e-3, 0.9, 0.95])
    lr, wd, b1, b2 = 1e-2, 1e-2, 0.9, 0.999
    return torch.tensor([1 - lr * wd, wd, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2**step), 1e-8, lr / (1 - b1**step), b1])


def random_patterns(n, dtype, g):
    bits = 16 if dtype != torch.float32 else 32
    raw = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (n,), dtype=torch.int64, generator=g)
    return raw.to(torch.int16 if bits == 16 else torch.int32).view(dtype)


def inputs(n, dtype, k, sr, state_dtype, n_states, g, *, garbage=False):
    """Ordinary values with special ones mixed in, or (``garbage``) random bit patterns everywhere.

    The extra bits: byte planes (a ``(bits // 8, n)`` uint8 tensor; no row for k = 0) for 0, 8 and 16 stored
    bits, else dense int32 words (zero bits past the last value, as ``packing.pack`` leaves them)."""
    bits = storage_bits(k, sr)
    if bits in (0, 8, 16):
        planes = torch.randint(0, 256, (bits // 8, n), dtype=torch.uint8, generator=g)
    else:
        planes = pack(torch.randint(0, 2**bits, (n,), dtype=torch.int32, generator=g), bits)
    if garbage:
        return (random_patterns(n, dtype, g), random_patterns(n, dtype, g), planes,
                [random_patterns(n, state_dtype, g) for _ in range(n_states)])
    scale = 2.0 ** torch.randint(-20, 10, (n,), generator=g).float()
    half = (torch.randn(n, generator=g) * scale).to(dtype)
    grad = (torch.randn(n, generator=g) * scale * 1e-3).to(dtype)
    states = [(torch.randn(n, generator=g).abs() * 1e-3).to(state_dtype) for _ in range(n_states)]
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 3.4e38, -3.4e38, 65504.0,
                             6e-8, -6e-8, 2.0**-14, 1 + 2.0**-8, 1 + 3 * 2.0**-8])
    for t in (half, grad, *states):
        idx = torch.randint(0, n, (n // 16,), generator=g)
        t[idx] = specials[torch.randint(0, len(specials), (n // 16,), generator=g)].to(t.dtype)
    # 16-bit patterns: subnormals, the largest finite values, signalling NaNs
    pats = torch.tensor([0x0001, 0x8001, 0x03FF, 0x7F7F, 0xFF7F, 0x7BFF, 0xFBFF, 0x7F81, 0x7C01, 0x7FFF, 0x0080],
                        dtype=torch.int32).to(torch.int16)
    idx = torch.randint(0, n, (n // 16,), generator=g)
    half.view(torch.int16)[idx] = pats[torch.randint(0, len(pats), (n // 16,), generator=g)]
    return half, grad, planes, states


def widened_apart(grad):
    """Where ATen's own fp16 -> fp32 widening of ``grad`` is not the vector loop's: an fp16 NaN widens to its
    quieted payload in ATen's vector loop and to 0x7FFFFFFF in its scalar tail, so there the eager step's
    NaN payloads depend on where the value sits (the kernels take the vector loop's)."""
    if grad.dtype != FP16:
        return torch.zeros(grad.shape, dtype=torch.bool)
    bits = grad.view(torch.int16).to(torch.int32) & 0xFFFF
    nan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0)
    vector = ((bits & 0x8000) << 16) | 0x7FC00000 | ((bits & 0x3FF) << 13)
    return nan & (grad.float().view(torch.int32) != vector)


def assert_same_bits(a, b, *, nan_at=None):
    """Bit-equal tensors; at ``nan_at`` (positions of ``widened_apart``) both NaN, any payload."""
    for x, y in zip(a, b, strict=True):
        xi = x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32) if x.element_size() == 4 else x
        yi = y.view(torch.int16) if y.element_size() == 2 else y.view(torch.int32) if y.element_size() == 4 else y
        if nan_at is not None and x.is_floating_point() and nan_at.any():
            assert x[nan_at].isnan().all() and y[nan_at].isnan().all()
            xi, yi = xi[~nan_at], yi[~nan_at]
        diff = (xi != yi).nonzero().flatten()
        assert diff.numel() == 0, f"{diff.numel()} values differ, first at {diff[:5].tolist()}"


