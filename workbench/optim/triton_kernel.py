"""A hand-written Triton kernel for the packed optimizers' step, every width: one launch per group or parameter.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1: merge the
16-bit value with its extra bits, update in fp32, split back ("16bits only mixed-precision"), over a
group's parameters as one stream of values (the "Fused" optimizers), with the extra bits packed densely
into int32 words (Fig 1). The paper's fused kernels take 8 and 16 extra bits only; this one takes every k.

The kernel runs :func:`workbench.optim.update.packed_update` for every format: extra bits as uint8 byte
planes (8 or 16 stored bits), as dense int32 words (any stored width, 1 to 17 bits: k = 1..16 for bf16,
1..13 for fp16, one more bit with stochastic rounding), or none (k = 0); Adam(W) (with ``amsgrad`` and
``maximize``) or SGD (momentum, Nesterov, ``maximize``), fp32 or bf16 states, truncated or stochastic
master rounding, loss-scaled gradients (``scaled``). It reads each value, gradient, state and byte
plane once and writes each once. A dense word is read by the lanes whose values it holds and written by
one lane, which gathers the new values overlapping it (at most ceil(32 / bits) + 1) from the block with
``tl.gather``: the exchange the paper's kernel does through shared memory. The per-parameter form
(``step_in_backward``) is the same kernel on one parameter's segment, with no temporaries.

Contract: the reference is the eager step on CPU (``update.packed_update``): the paper's arithmetic in
binary32, each operation rounded to nearest once, subnormals kept, ``torch.neg``'s sign of zero. The
kernel gives its bits for every number: the same operations in the same order, no fused multiply-add,
``div_rn`` and ``sqrt_rn`` (correctly rounded, as eager's division and its float64 square root), no
flushing of subnormals, negation as a sign-bit flip, and the random bits of ``rng.hash_noise``
computed per element from (key, index). NaN payloads are the device's own (numpy's x86 rules in
Triton's interpreter, the GPU's canonical NaN on CUDA): against the eager CPU step a NaN must be a NaN
of any payload; against the eager step run on CUDA, whose ATen kernels give the same canonical NaNs, the
bits are equal, payloads included.

What the first H100 run's failure of that test was (``test_cuda_equals_the_eager_cuda_step_bit_for_bit``,
Triton 3.6): not eager CUDA. The failing case was the sixth algorithm of the test (AdamW with amsgrad and
maximize), not the first: the five before it passed bit for bit, with and without random bit patterns
(the reprs in the log are those of the amsgrad case: three states). Triton 3.6 compiles a float
negation ``-g`` as ``0 - g`` (fixed upstream by triton-lang/triton#10270; 3.9's ``fneg``), so maximize
turned a +0.0 gradient into +0.0 where ``torch.neg`` gives -0.0, and exp_avg = (-0.0) * beta1 + (+0.0) *
(1 - beta1) came out +0.0 where eager keeps -0.0. Reproduced on CPU from the test's seeded inputs: the
positions where the gradient is +0.0 and exp_avg was -0.0 are exactly the ones the run listed, and as
many (bf16+8 and bf16+7 SR: 2, at 2000 and 20324; bf16+16 and bf16+15 SR: 1, at 26491; fp16+8 and fp16+7
SR: 25, first at 2000, 4663, 5444, 9630, 12090). Emulating eager CUDA's candidate differences instead
(each multiply-add contracted into an FMA, division by a reciprocal, an fp32 square root) changes
hundreds to thousands of other values and none of those. The kernel now negates by flipping the sign bit.

On CUDA it is compiled by Triton at the first call of each format (seconds, then in Triton's cache).
CPU tensors run through Triton's interpreter (numpy, slow): that is how its tests run on a machine
without a GPU; :func:`triton_step` offers the kernel to the optimizers on CUDA only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch
from torch._subclasses.fake_tensor import FakeTensor

try:
    import triton.language as tl
except ImportError:  # the module still imports; available() says False
    tl = None

from workbench.optim.formats import FORMATS, storage_bits
from workbench.optim.kernel_args import extra_layout, flat_args_reason, planes_of
from workbench.optim.update import adam_math, chunked_update, sgd_math

__all__ = ["available", "kernel_update", "packed_update_triton", "supports", "triton_step", "unsupported_reason"]

# NOTE: hand-written because the torch.compile'd step (inductor's Triton code) measured 0.88-1.00x of
# torch.optim.AdamW(fused=True) on an H100 with fp32 moments, at 62-68% of measured bandwidth where
# torch reached 76-79% (issue 21), and 0.043x with dense words (bf16+12, issue 34): one flat launch with
# plain elementwise loads, each byte moved once.

# the options each algorithm's kernel reads (any other option, switched on, is refused)
_OPTIONS = {adam_math: {"decoupled", "amsgrad", "maximize"}, sgd_math: {"momentum", "nesterov", "first", "maximize"}}
_BLOCK = {"cuda": 1024, "cpu": 1 << 14}  # values per program; the interpreter runs programs one by one
_MAX_VALUES = 2**31 - 1  # the hash's index (and eager's arange) is int32
_STORE = {"none": 0, "planes": 1, "words": 2}


def _next_power_of_two(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


# NOTE: one plain function, without helper functions, so the same source runs jit-compiled and
# interpreted (Triton's compiler calls only @triton.jit helpers, its interpreter only interpreted ones).
def _step_body(half_ptr, grad_ptr, x0_ptr, x1_ptr, s0_ptr, s1_ptr, s2_ptr, coef_ptr, key, offset, n,
               IS_BF16: tl.constexpr, EXTRA_BITS: tl.constexpr, SR: tl.constexpr, MASTER_SR: tl.constexpr,
               MATH: tl.constexpr, DECOUPLED: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               FIRST: tl.constexpr, MAXIMIZE: tl.constexpr, AMSGRAD: tl.constexpr, SCALED: tl.constexpr,
               N_COEF: tl.constexpr, STATE_BF16: tl.constexpr, NATIVE_BF16: tl.constexpr, STORE: tl.constexpr,
               WORDS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """One program: BLOCK values of the stream (merge, fp32 step, split), in eager's order of operations.

    MATH: 0 Adam(W), 1 SGD. STORE: the extra bits in 0 none, 1 byte planes (x0, x1), 2 dense int32 words
    (x0; WORDS_P2 is the power of two at or above the block's BLOCK * bits / 32 words). NATIVE_BF16: round
    bf16 states with the device's own conversion (CUDA's cvt.rn), else bit by bit as ATen's vectorised
    CPU conversion (NaN becomes 0xFFFF).
    """
    FULL: tl.constexpr = 16 if IS_BF16 else 13
    INF: tl.constexpr = 0x7F80 if IS_BF16 else 0x7C00
    DROP: tl.constexpr = FULL - EXTRA_BITS
    BITS: tl.constexpr = EXTRA_BITS + SR
    WORDS: tl.constexpr = BLOCK * BITS // 32  # a block starts and ends on a word boundary
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    # ---- decode and merge (packing.decode, split_merge.merge_values)
    hb = tl.load(half_ptr + i, mask=live, other=0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if STORE == 1:
        values = tl.load(x0_ptr + i, mask=live, other=0).to(tl.int32)
        if BITS == 16:
            values = values | (tl.load(x1_ptr + i, mask=live, other=0).to(tl.int32) << 8)
    elif STORE == 2:
        # value j of the block: bits [j * BITS, (j + 1) * BITS) of its words, LSB first, maybe in two words
        at = tl.arange(0, BLOCK) * BITS
        lo, shift = at >> 5, at & 31
        spill = shift + BITS > 32
        words = x0_ptr + pid * WORDS
        w0 = tl.load(words + lo, mask=live, other=0).to(tl.uint32, bitcast=True)
        w1 = tl.load(words + lo + 1, mask=live & spill, other=0).to(tl.uint32, bitcast=True)
        up = tl.where(spill, 32 - shift, 0).to(tl.uint32)  # every shift amount within 0..31
        joined = (w0 >> shift.to(tl.uint32)) | tl.where(spill, w1 << up, 0)
        values = (joined & ((1 << BITS) - 1)).to(tl.int32, bitcast=True)
    else:
        values = hb * 0
    if SR:
        hb = hb - (values & 1)
        values = values >> 1
    low = values << DROP
    if IS_BF16:
        master = ((hb << 16) | low).to(tl.float32, bitcast=True)
    else:
        e = hb & 0x7C00
        normal_mag = (((hb & 0x7FFF) << 13) + (112 << 23)) | low
        q = ((hb & 0x3FF) << 13) | low
        small_mag = (q.to(tl.float32) * 7.275957614183426e-12).to(tl.int32, bitcast=True)  # * 2**-37
        special_mag = 0x7F800000 | tl.where((hb & 0x3FF) != 0, 0x400000 | ((hb & 0x3FF) << 13), 0)
        mag = tl.where(e == 0, small_mag, tl.where(e == 0x7C00, special_mag, normal_mag))
        master = (((hb & 0x8000) << 16) | mag).to(tl.float32, bitcast=True)
    # NOTE: bf16 widens by a shift (exact everywhere; the interpreter's own bf16 conversion mishandles
    # subnormals); fp16 by conversion, exact.
    g = tl.load(grad_ptr + i, mask=live, other=0)
    if IS_BF16:
        g = (g.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        g = g.to(tl.float32)
    if MATH == 0 or (MOMENTUM and not FIRST):
        s0 = tl.load(s0_ptr + i, mask=live, other=0)
        if STATE_BF16:
            s0 = (s0.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if MATH == 0:
        s1 = tl.load(s1_ptr + i, mask=live, other=0)
        if STATE_BF16:
            s1 = (s1.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if AMSGRAD:
        s2 = tl.load(s2_ptr + i, mask=live, other=0)
        if STATE_BF16:
            s2 = (s2.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if SCALED:
        clip = tl.load(coef_ptr + N_COEF - 1)
        low_clip = (clip.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)  # -clip
        g = g * tl.load(coef_ptr + N_COEF - 2)
        g = tl.where(g != g, g, tl.maximum(g, low_clip))  # torch.maximum: a NaN operand is returned as it is
        g = tl.where(g != g, g, tl.minimum(g, clip))
    if MAXIMIZE:  # torch.neg: the sign bit flipped (Triton 3.6 compiled -g as 0 - g: -(+0.0) gave +0.0)
        g = (g.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)
    # ---- the update (update.adam_math / update.sgd_math); states are kept as they are computed
    if MATH == 0:
        if DECOUPLED:
            master = master * tl.load(coef_ptr + 0)
        else:
            g = g + tl.load(coef_ptr + 1) * master
        m = s0 * tl.load(coef_ptr + 8) + g * tl.load(coef_ptr + 2)
        v = s1 * tl.load(coef_ptr + 3) + g * g * tl.load(coef_ptr + 4)
        kept = (m, v)
        if AMSGRAD:
            v = tl.where(s2 != s2, s2, tl.where(v != v, v, tl.maximum(s2, v)))
            kept = (m, kept[1], v)
        denom = tl.div_rn(tl.sqrt_rn(v), tl.load(coef_ptr + 5)) + tl.load(coef_ptr + 6)
        master = master - tl.load(coef_ptr + 7) * tl.div_rn(m, denom)
    else:
        g = g + tl.load(coef_ptr + 1) * master
        kept = ()
        if MOMENTUM:
            if FIRST:
                new = g
            else:
                new = s0 * tl.load(coef_ptr + 2) + tl.load(coef_ptr + 3) * g
            kept = (new,)
            if NESTEROV:
                g = g + tl.load(coef_ptr + 2) * new
            else:
                g = new
        master = master - tl.load(coef_ptr + 0) * g
    for j in tl.static_range(len(kept)):
        ptr = s0_ptr if j == 0 else s1_ptr if j == 1 else s2_ptr
        if STATE_BF16:
            if NATIVE_BF16:
                tl.store(ptr + i, kept[j].to(tl.bfloat16), mask=live)
            else:
                b = kept[j].to(tl.int32, bitcast=True)
                r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
                r = tl.where(kept[j] != kept[j], 0xFFFF, r)
                tl.store(ptr + i, r.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=live)
        else:
            tl.store(ptr + i, kept[j], mask=live)
    # ---- split (split_merge.split_values), with rng.hash_noise's bits for this index
    bits = master.to(tl.int32, bitcast=True)
    if IS_BF16:
        hb = (bits >> 16) & 0xFFFF
        low = bits & 0xFFFF
    else:
        mag = bits & 0x7FFFFFFF
        normal = (mag >= 0x38800000) & (mag < 0x47800000)
        small = mag < 0x38800000
        overflow = (mag >= 0x47800000) & (mag < 0x7F800000)
        q = (tl.abs(tl.where(small, master, 0.0)) * 137438953472.0).to(tl.int32)  # * 2**37, truncated
        hb = tl.where(normal, (mag >> 13) - (112 << 10), q >> 13)
        low = tl.where(normal, mag & 0x1FFF, q & 0x1FFF)
        hb = tl.where(overflow, 0x7BFF, hb)
        low = tl.where(overflow, 0x1FFF, low)
        special = mag >= 0x7F800000
        hb = tl.where(special, 0x7C00 | tl.where(mag > 0x7F800000, 0x200 | ((mag >> 13) & 0x3FF), 0), hb)
        low = tl.where(special, 0, low)
        hb = ((bits >> 16) & 0x8000) | hb
    if SR or MASTER_SR:
        h = (i + offset) * -1640531535 + key
        h = h ^ ((h >> 16) & 0xFFFF)
        h = h * -2048144789
        h = h ^ ((h >> 13) & 0x7FFFF)
        h = h * -1028477387
        h = h ^ ((h >> 16) & 0xFFFF)
    if IS_BF16 and EXTRA_BITS < FULL:
        nan_bit = ((0x7F800000 - (((hb & 0x7FFF) << 16) | low)) >> 31) & 0x40
    if MASTER_SR and EXTRA_BITS < FULL:
        sign = hb & 0x8000
        mag16 = hb & 0x7FFF
        z = (mag16 << FULL) | low
        r = h & ((1 << DROP) - 1)
        ok = ((mag16 - INF) & (((z + r) >> FULL) - INF)) >> 31
        z = z + (r & ok)
        hb = sign | (z >> FULL)
        low = ((z & ((1 << FULL) - 1)) >> DROP) << DROP
    values = low >> DROP
    if IS_BF16 and EXTRA_BITS < FULL:
        hb = hb | nan_bit
    if SR:
        noise = (h >> 16) & ((1 << FULL) - 1)
        up = (((noise - low) & ((hb & 0x7FFF) + 1 - INF)) >> 31) & 1
        hb = hb + up
        values = (values << 1) | up
    if IS_BF16:
        tl.store(half_ptr + i, hb.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=live)
    else:
        tl.store(half_ptr + i, hb.to(tl.int16).to(tl.float16, bitcast=True), mask=live)
    if STORE == 1:
        tl.store(x0_ptr + i, (values & 0xFF).to(tl.uint8), mask=live)
        if BITS == 16:
            tl.store(x1_ptr + i, ((values >> 8) & 0xFF).to(tl.uint8), mask=live)
    elif STORE == 2:
        # word w of the block: the new values overlapping its bits [32 w, 32 w + 32), each shifted into place
        # (values past n count as 0: eager's packing pads the last word with zero bits)
        new = tl.where(live, values, 0).to(tl.uint32, bitcast=True)
        w = tl.arange(0, WORDS_P2)
        first = (w * 32) // BITS
        word = (w * 0).to(tl.uint32)
        for j in tl.static_range((32 + BITS - 1) // BITS + 1):
            v = first + j
            at = v * BITS - w * 32  # where value v starts, from the word's first bit (< 0: it began before)
            inside = (at < 32) & (v < BLOCK)
            got = tl.gather(new, tl.minimum(v, BLOCK - 1), 0)
            left = tl.where(inside & (at > 0), at, 0).to(tl.uint32)
            right = tl.where(inside & (at < 0), -at, 0).to(tl.uint32)
            word = word | tl.where(inside, (got << left) >> right, 0)
        n_words = (n // 32) * BITS + ((n % 32) * BITS + 31) // 32
        tl.store(x0_ptr + pid * WORDS + w, word.to(tl.int32, bitcast=True),
                 mask=(w < WORDS) & (pid * WORDS + w < n_words))


@functools.cache
def _kernel(interpret: bool):
    """The step as a Triton kernel: jit-compiled (CUDA) or run by Triton's interpreter (CPU tensors)."""
    import triton

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_step_body)
    # key and offset change every step: no recompilation for their values
    return triton.jit(_step_body, do_not_specialize=["key", "offset"])


def available() -> bool:
    """True when Triton can be imported (it ships with torch's CUDA wheels; ``pip install triton`` elsewhere)."""
    return tl is not None


def unsupported_reason(
    half: torch.Tensor, grad: torch.Tensor, extra: Any, states: Sequence[torch.Tensor], coef: torch.Tensor, *,
    math_fn: Callable, extra_bits: int, stochastic_rounding: bool, master_rounding: str = "truncate",
    options: dict[str, Any], scaled: bool = False,
) -> str | None:
    """Why the kernel cannot run this update (None when it can); checks the arguments, compiles nothing."""
    if math_fn not in _OPTIONS:
        return f"math_fn {getattr(math_fn, '__name__', math_fn)!r}: only adam_math and sgd_math"
    if not torch.is_tensor(half) or half.device.type not in ("cuda", "cpu"):
        return "half must be a CUDA tensor (or a CPU tensor, run by Triton's interpreter)"
    if half.numel() > _MAX_VALUES:
        return f"{half.numel():,} values: the kernel indexes at most {_MAX_VALUES:,}"
    unknown = sorted(k for k, on in options.items() if on and k not in _OPTIONS[math_fn])
    if unknown:
        return f"options the kernel does not implement: {unknown}"
    n_states = (3 if options.get("amsgrad") else 2) if math_fn is adam_math else int(bool(options.get("momentum")))
    n_coef = (9 if math_fn is adam_math else 4) + 2 * bool(scaled)
    return flat_args_reason(half, grad, extra, states, coef, device_type=half.device.type, extra_bits=extra_bits,
                            stochastic_rounding=stochastic_rounding, master_rounding=master_rounding,
                            n_states=n_states, n_coef=n_coef, planes=(0, 1, 2), words=True)


def supports(half, grad, extra, states, coef, **static) -> bool:
    """True when the kernel can run this update (:func:`unsupported_reason` is None)."""
    return unsupported_reason(half, grad, extra, states, coef, **static) is None


def packed_update_triton(
    half: torch.Tensor, grad: torch.Tensor, extra: Sequence[torch.Tensor] | torch.Tensor,
    states: Sequence[torch.Tensor], coef: torch.Tensor, key: torch.Tensor | int | None, *, math_fn: Callable,
    extra_bits: int, stochastic_rounding: bool, master_rounding: str = "truncate", options: dict[str, Any],
    scaled: bool = False, offset: int = 0,
) -> None:
    """:func:`workbench.optim.update.packed_update` (same arguments, same bits) run by the Triton kernel.

    ``extra`` is the list of byte planes (or their ``(planes, n)`` uint8 tensor), the dense int32 words, or
    (k = 0) empty. Raises ValueError for an update the kernel does not take (see :func:`unsupported_reason`)
    and RuntimeError without Triton.
    """
    static = dict(math_fn=math_fn, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding,
                  master_rounding=master_rounding, options=options, scaled=scaled)
    reason = unsupported_reason(half, grad, extra, states, coef, **static)
    if reason is not None:
        raise ValueError(f"the Triton packed-step kernel does not take this update: {reason}")
    if not available():
        raise RuntimeError("the Triton packed-step kernel needs triton (pip install triton)")
    _run(half, grad, extra, states, coef, key, offset=offset, **static)


def _launch_options(device_type: str) -> dict[str, Any]:
    if device_type == "cpu":
        return {}
    # NOTE: Triton contracts a*b + c into one FMA by default (eager rounds twice) and its libdevice
    # division and square root flush subnormals; eager CUDA does neither.
    from triton.backends.nvidia.compiler import CUDAOptions

    extra = {"enable_reflect_ftz": False} if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__ else {}
    return {"num_warps": 4, "enable_fp_fusion": False, **extra}


def _run(half, grad, extra, states, coef, key, *, math_fn, extra_bits, stochastic_rounding, master_rounding,
         options, scaled=False, offset=0) -> None:
    """The launch itself, for arguments :func:`unsupported_reason` accepted."""
    if key is None and (stochastic_rounding or master_rounding == "stochastic"):
        raise ValueError("stochastic rounding needs a random key")
    if isinstance(half, FakeTensor):
        return  # CalcGraph's plan of a step (fake tensors): the in-place update allocates nothing
    device_type = half.device.type
    bits = storage_bits(extra_bits, stochastic_rounding)
    store = extra_layout(extra, bits)
    x = planes_of(extra, bits) if store == "planes" else [extra] if store == "words" else [half]
    n, block = half.numel(), _BLOCK[device_type]
    s = list(states) + [half] * (3 - len(states))  # unused state pointers: never read nor written
    kernel = _kernel(device_type == "cpu")
    # NOTE: the interpreter computes with numpy, which warns on the infinities and NaNs IEEE arithmetic
    # produces on purpose here (the compiled kernel, like eager torch, does not).
    quiet = numpy.errstate(all="ignore") if device_type == "cpu" else contextlib.nullcontext()
    with quiet:
        kernel[(-(-n // block),)](
            half, grad, x[0], x[-1], s[0], s[1], s[2], coef, int(key or 0), int(offset), n,
            IS_BF16=half.dtype == torch.bfloat16, EXTRA_BITS=int(extra_bits), SR=bool(stochastic_rounding),
            MASTER_SR=master_rounding == "stochastic", MATH=0 if math_fn is adam_math else 1,
            DECOUPLED=bool(options.get("decoupled")), MOMENTUM=bool(options.get("momentum")),
            NESTEROV=bool(options.get("nesterov")), FIRST=bool(options.get("first")),
            MAXIMIZE=bool(options.get("maximize")), AMSGRAD=bool(options.get("amsgrad")), SCALED=bool(scaled),
            N_COEF=coef.numel(), STATE_BF16=bool(states) and states[0].dtype == torch.bfloat16,
            NATIVE_BF16=device_type == "cuda", STORE=_STORE[store], WORDS_P2=_next_power_of_two(block * bits // 32),
            BLOCK=block, **_launch_options(device_type),
        )


def kernel_update(fallback: Callable | None = None, **static: Any) -> Callable:
    """The step ``(half, grad, extra, states, coef, key)`` with :func:`packed_update`'s keywords bound: a flat
    group's stream, or one parameter (its segment of a flat group, or its own tensors).

    Each call runs the Triton kernel when it takes the update, else ``fallback`` (None: the eager
    chunked update). If the first launch fails (no working compiler or driver), it warns once and
    runs the fallback from then on.
    """
    if fallback is None:
        bits = storage_bits(static["extra_bits"], static["stochastic_rounding"])

        def fallback(half, grad, extra, states, coef, key):
            chunked_update(half, grad, extra, states, coef, key, bits=bits, **static)

    status = {"built": False, "failed": False}  # the first launch builds the kernel

    def update(half, grad, extra, states, coef, key) -> None:
        if status["failed"] or not supports(half, grad, extra, states, coef, **static):
            fallback(half, grad, extra, states, coef, key)
        elif status["built"]:
            _run(half, grad, extra, states, coef, key, **static)
        else:
            try:
                _run(half, grad, extra, states, coef, key, **static)
                status["built"] = True
            except Exception as e:  # noqa: BLE001 - a failed build: this and every later step without it
                # NOTE: a compiler or driver failure raises before the kernel writes anything, so the
                # fallback computes this step from the same inputs.
                status["failed"] = True
                first = str(e).splitlines()[0] if str(e) else ""
                warnings.warn(f"the Triton packed-step kernel failed to build ({type(e).__name__}: {first}); "
                              "using the fallback step from now on", RuntimeWarning, stacklevel=2)
                fallback(half, grad, extra, states, coef, key)

    return update


def triton_step(device: torch.device, spec, *, fallback: Callable | None = None) -> Callable | None:
    """The optimizers' backend (``fused.STEP_BACKENDS``, ``fused.PER_PARAMETER_BACKENDS``): the kernel on CUDA
    for every format, else None.

    Updates the kernel does not take (another algorithm, an option it lacks) run ``fallback`` (by default
    the compiled step, or the eager one). ``WORKBENCH_TRITON_KERNEL=0`` in the environment turns it off.
    """
    if (device.type != "cuda" or spec.dtype not in FORMATS or not available()
            or os.environ.get("WORKBENCH_TRITON_KERNEL", "1") == "0"):
        return None
    if fallback is None:
        from workbench.optim.fused import compiled_step, eager_step

        fallback = compiled_step(device, spec) or eager_step(device, spec)
    return kernel_update(fallback=fallback, **spec.static)
