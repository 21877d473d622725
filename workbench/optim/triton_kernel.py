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
``tl.gather``: the exchange the paper's kernel does through shared memory. A fused group's gradients are
read where autograd left them (a table of their addresses, no flat copy). The per-parameter form
(``step_in_backward``) is the same kernel on one parameter's segment, with no temporaries. Its source is
``workbench.optim.triton_source``.

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
SR: 25, first at 2000, 4663, 5444, 9630, 12090); the values printed in the log are those of that case.
The eager-CUDA candidates emulated first, on the first algorithm's inputs (each multiply-add contracted into
an FMA, a division by a reciprocal, an fp32 square root), change tens to thousands of values each, not a
few special ones. The kernel now negates by flipping the sign bit.

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
from workbench.optim.kernel_args import GradSegments, as_flat, extra_layout, flat_args_reason, planes_of
from workbench.optim.triton_source import step_body
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


@functools.cache
def _kernel(interpret: bool):
    """The step as a Triton kernel: jit-compiled (CUDA) or run by Triton's interpreter (CPU tensors)."""
    import triton

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(step_body)
    # key and offset change every step: no recompilation for their values
    return triton.jit(step_body, do_not_specialize=["key", "offset"])


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


def _segment_rows(segments: GradSegments, block: int, device: torch.device) -> torch.Tensor:
    """A row per program of a segmented launch: (its first value, its segment's start, length and index)."""
    lengths = tuple(g.numel() for g in segments.grads)
    k = (segments.offsets, lengths, block, device)
    if k not in _ROWS:
        if len(_ROWS) > 64:  # a few fused groups at a time
            _ROWS.clear()
        rows = [(start, at, count, index)
                for index, (at, count) in enumerate(zip(segments.offsets, lengths, strict=True))
                for start in range(at, at + count, block)]
        _ROWS[k] = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)
    return _ROWS[k]


_ROWS: dict[tuple, torch.Tensor] = {}


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
    if isinstance(grad, GradSegments) and any(g.data_ptr() % 16 for g in grad.grads):
        grad = grad.gather()  # NOTE: the segmented kernel loads 16-byte vectors; an odd view is copied instead
    segmented = isinstance(grad, GradSegments)
    if segmented:  # each gradient read where autograd left it: its address, and a row per program
        rows = _segment_rows(grad, block, half.device)
        grid = rows.shape[0]
        grad = torch.tensor([g.data_ptr() for g in grad.grads], dtype=torch.int64)
        if device_type == "cuda":
            # NOTE: pinned and non-blocking: a pageable copy would wait for the GPU to finish every queued step
            grad = grad.pin_memory().to(half.device, non_blocking=True)
    else:
        rows, grid = half, -(-n // block)  # no table: an unused pointer
    if grid == 0:
        return
    s = list(states) + [half] * (3 - len(states))  # unused state pointers: never read nor written
    kernel = _kernel(device_type == "cpu")
    # NOTE: the interpreter computes with numpy, which warns on the infinities and NaNs IEEE arithmetic
    # produces on purpose here (the compiled kernel, like eager torch, does not).
    quiet = numpy.errstate(all="ignore") if device_type == "cpu" else contextlib.nullcontext()
    with quiet:
        kernel[(grid,)](
            half, grad, rows, x[0], x[-1], s[0], s[1], s[2], coef, int(key or 0), int(offset), n,
            IS_BF16=half.dtype == torch.bfloat16, EXTRA_BITS=int(extra_bits), SR=bool(stochastic_rounding),
            MASTER_SR=master_rounding == "stochastic", MATH=0 if math_fn is adam_math else 1,
            DECOUPLED=bool(options.get("decoupled")), MOMENTUM=bool(options.get("momentum")),
            NESTEROV=bool(options.get("nesterov")), FIRST=bool(options.get("first")),
            MAXIMIZE=bool(options.get("maximize")), AMSGRAD=bool(options.get("amsgrad")), SCALED=bool(scaled),
            N_COEF=coef.numel(), STATE_BF16=bool(states) and states[0].dtype == torch.bfloat16,
            NATIVE_BF16=device_type == "cuda", STORE=_STORE[store], WORDS_P2=_next_power_of_two(block * bits // 32),
            SEGMENTED=segmented, BLOCK=block, NEAREST=master_rounding == "nearest", **_launch_options(device_type),
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
            fallback(half, as_flat(grad), extra, states, coef, key)
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
                fallback(half, as_flat(grad), extra, states, coef, key)

    return update


def triton_step(device: torch.device, spec, *, fallback: Callable | None = None) -> Callable | None:
    """The optimizers' backend (``fused.STEP_BACKENDS``, ``fused.PER_PARAMETER_BACKENDS``): the kernel on CUDA
    for every format, else None.

    Updates the kernel does not take (another algorithm, an option it lacks) run ``fallback`` (by default
    the compiled step, or the eager one). ``WORKBENCH_TRITON_KERNEL=0`` in the environment turns it off.
    """
    # NOTE: 8-bit moments (state_dtype=torch.int8, ``quantized``) are not in the Triton kernel yet: their fused
    # groups take the compiled step, one parameter's step the eager one
    if (device.type != "cuda" or spec.dtype not in FORMATS or spec.state_dtype == torch.int8 or not available()
            or os.environ.get("WORKBENCH_TRITON_KERNEL", "1") == "0"):
        return None
    if fallback is None:
        from workbench.optim.fused import compiled_step, eager_step

        fallback = compiled_step(device, spec) or eager_step(device, spec)
    return kernel_update(fallback=fallback, **spec.static)
