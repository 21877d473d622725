"""The elementwise update behind the packed optimizers: merge, fp32 step, split (Lewandowski & Kosson, 3.1).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1.
``packed_update`` reconstructs the fp32 master value from the 16-bit parameter and its extra bits
(dense int32 words, or uint8 byte planes for 8- and 16-bit widths), applies torch.optim.SGD's or
Adam(W)'s update in fp32 and splits the result back. It runs eagerly (in chunks, per parameter or
over a fused flat stream) or ``torch.compile``d into one loop (C++ on CPU, Triton on CUDA); all
paths give the same bits.

Randomness (stochastic rounding of the 16-bit value, stochastic master rounding) comes from
``rng.hash_noise``: a counter-based hash of (key, index) computed next to each value, so neither
path allocates a noise buffer the size of the tensor.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workbench.optim.formats import max_extra_bits, storage_bits
from workbench.optim.packing import decode, packed_words, store_into
from workbench.optim.quantized import dequantize_states, quantize_states, slice_states
from workbench.optim.rng import hash_noise
from workbench.optim.split_merge import merge_values, nearest_offset, split_values

__all__ = ["CHUNK", "packed_update", "chunked_update", "compiled_update", "sgd_math", "adam_math"]

# NOTE: the eager path updates large parameters in chunks of this many values (a multiple of 32,
# so chunks start on word boundaries) to bound the fp32/int temporaries a step allocates; the
# paper's CUDA kernel has none, and Fig 2 measures peak memory.
CHUNK = 1 << 15
# On a GPU each chunk costs ~30 kernel launches: 2**20 values keep a 0.5e9-parameter step to a few
# hundred chunks, with ~40 MB of temporaries (under 1% of such a model's peak).
CUDA_CHUNK = 1 << 20

Extra = torch.Tensor | Sequence[torch.Tensor]


def _keep(state: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Store the fp32 ``value`` into ``state`` (fp32, or bf16 rounded to nearest) and return ``value``.

    # NOTE: the step uses the fp32 moments it just computed; only what is kept for the next step
    # is rounded to bf16 (one rounding per stored value, the same eagerly and compiled). Reading
    # the rounded value back would cost a bit-level rounding in the kernel, since inductor drops a
    # .to(bf16).float() round trip; it was measured about 1.5x slower per step on CPU.
    """
    state.copy_(value)
    return value


def sgd_math(master, g, states, coef, *, momentum: bool, nesterov: bool, first: bool, maximize: bool = False):
    """torch.optim.SGD's update on the fp32 master value; coef = [lr, wd, mom, 1 - dampening]."""
    if maximize:
        g = -g
    g = g + coef[1] * master
    if momentum:
        (buf,) = states
        new = g if first else buf.float() * coef[2] + coef[3] * g
        new = _keep(buf, new)
        g = g + coef[2] * new if nesterov else new
    return master - coef[0] * g


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root on both paths.

    # NOTE: inductor's vectorized sqrt is IEEE-exact, eager CPU fp32 sqrt is not always (about
    # 0.6% of values differ by an ulp), so the eager path goes through float64, which rounds
    # correctly; the results are bit-identical and the compiled kernel stays vectorized.
    """
    if torch.compiler.is_compiling():
        return x.sqrt()
    return x.double().sqrt().float()


def adam_math(master, g, states, coef, *, decoupled: bool, amsgrad: bool = False, maximize: bool = False):
    """torch.optim.Adam(W)'s update (``amsgrad``: states end with the running max of the second moment).

    coef = [1 - lr*wd, wd, 1 - b1, b2, 1 - b2, sqrt(1 - b2**t), eps, lr / (1 - b1**t), b1].
    """
    exp_avg, exp_avg_sq = states[0], states[1]
    if maximize:
        g = -g
    if decoupled:
        master = master * coef[0]
    else:
        g = g + coef[1] * master
    # NOTE: written without lerp_ (eager CPU lerp rounds differently from inductor's code) so the
    # compiled and eager paths give the same bits. Same formula as torch's AdamW, so parity holds
    # to a few fp32 ulps.
    m = _keep(exp_avg, exp_avg.float() * coef[8] + g * coef[2])
    v = _keep(exp_avg_sq, exp_avg_sq.float() * coef[3] + g * g * coef[4])
    if amsgrad:
        v = _keep(states[2], torch.maximum(states[2].float(), v))
    denom = _sqrt(v) / coef[5] + coef[6]
    return master - coef[7] * (m / denom)


def packed_update(
    half: torch.Tensor,
    grad: torch.Tensor,
    extra: Extra,
    states: list[torch.Tensor],
    coef: torch.Tensor,
    key: torch.Tensor | int | None,
    *,
    math_fn: Callable,
    extra_bits: int,
    stochastic_rounding: bool,
    master_rounding: str = "truncate",
    options: dict[str, Any],
    scaled: bool = False,
    quantized: tuple[str, ...] = (),
    offset: int = 0,
) -> None:
    """One in-place update of 1-D ``half`` (and its ``extra`` bits and ``states``): merge, step, split.

    ``extra`` is int32 words (``half``'s first value on a 32-value boundary of the packed stream)
    or a list of 1-D uint8 byte planes. ``key`` seeds the per-element random bits (needed with
    stochastic rounding or ``master_rounding="stochastic"``; ``"nearest"`` rounds the 16-bit value to
    nearest over truncate's extra bits, see ``split_merge``); ``offset`` is the index of
    ``half[0]`` in the stream the key numbers. ``scaled``: the last two entries of ``coef`` are
    (1 / loss scale, clip value); the gradient is unscaled and clipped by value in fp32 first.
    ``quantized``: the states are 8-bit moments (``workbench.optim.quantized``), ``states`` holds a (codes,
    scales) pair per kind listed; they are read as fp32, stepped and stored back (groups of 32 values from
    ``half[0]``).
    """
    bits = storage_bits(extra_bits, stochastic_rounding)
    n = half.numel()
    values = decode(extra, bits, n)
    nearest = master_rounding == "nearest"
    master = merge_values(half, values, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding,
                          nearest=nearest)
    g = grad.float()
    if scaled:
        # NOTE: unscaling in fp32 inside the step is what torch.amp.GradScaler cannot do for fp16
        # gradients (it unscales them in place, in fp16, and refuses). Paper 4.1: loss scaling and
        # clipping become part of the optimizer when the step is fused.
        clip = coef[-1]
        g = torch.minimum(torch.maximum(g * coef[-2], -clip), clip)
    if quantized:
        stored, states = states, dequantize_states(states, quantized)
    master = math_fn(master, g, states, coef, **options)
    if quantized:
        quantize_states(states, stored, quantized)
    del g  # freed before the split's temporaries exist (the eager step's peak)
    noise = master_noise = None
    if stochastic_rounding or master_rounding == "stochastic":
        if key is None:
            raise ValueError("stochastic rounding needs a random key")
        h = hash_noise(n, key, offset, device=half.device)
        if stochastic_rounding:
            noise = (h >> 16) & ((1 << max_extra_bits(half.dtype)) - 1)
        if master_rounding == "stochastic":
            master_noise = h
    elif nearest:
        master_noise = nearest_offset(half.dtype, extra_bits)
    new_half, new_values = split_values(
        master, dtype=half.dtype, extra_bits=extra_bits,
        stochastic_rounding=stochastic_rounding, noise=noise, master_noise=master_noise, nearest=nearest,
    )
    half.copy_(new_half)
    store_into(extra, new_values, bits)


def chunked_update(half, grad, extra, states, coef, key, *, bits: int, **kw) -> None:
    """:func:`packed_update` over CHUNK-value slices (bounded temporaries, same bits)."""
    n = half.numel()
    planes = isinstance(extra, list | tuple)
    chunk = CHUNK if half.device.type == "cpu" else CUDA_CHUNK
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        if planes:
            ex = [pl[s:e] for pl in extra]
        else:
            ws = s * bits // 32
            ex = extra[ws : ws + packed_words(e - s, bits)]
        quantized = kw.get("quantized")
        part = slice_states(states, quantized, s, e) if quantized else [t[s:e] for t in states]
        packed_update(half[s:e], grad[s:e], ex, part, coef, key, offset=s, **kw)


_COMPILED: dict[tuple, Callable] = {}

# NOTE: by default Triton contracts a*b + c into one FMA (one rounding where eager rounds twice),
# divides with the approximate div.full and flushes denormals to zero: measured on an H100, the
# moments came out 1 fp32 ulp from eager in 38% of values. These inductor options (the names of
# torch 2.11 to 2.13 that this torch knows) make the Triton step keep eager CUDA's bits.
_EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding", "eager_numerics.disable_ftz",
                   "emulate_divison_rounding", "emulate_division_rounding")


def _cuda_eager_numerics() -> dict[str, bool]:
    known = torch._inductor.config.get_config_copy()
    return {name: True for name in _EAGER_NUMERICS if name in known}


def compiled_update(*, dynamic: bool = False, device_type: str = "cpu", key: tuple = (), **static) -> Callable:
    """A process-wide ``torch.compile``d :func:`packed_update` with its format arguments bound.

    ``static`` holds :func:`packed_update`'s keyword arguments (math_fn, extra_bits, rounding,
    options); the result takes ``(half, grad, extra, states, coef, key)``. One compiled function
    per ``(dynamic, device_type, key, static)``. ``dynamic=False`` (the fused flat step with dense
    words): every group size gets its own specialised kernel. ``dynamic=True`` (byte planes, and
    the per-parameter step inside backward): the tensors' length is symbolic, so one kernel per
    format serves every size. ``key`` names what else tells formats apart (dtypes).
    """
    # NOTE: static shapes for dense words: automatic dynamic shapes, torch's default after a
    # recompile, made the dense-packing kernels several times slower on CPU (indexed loads). Byte
    # planes are pure elementwise code, which inductor vectorises with a symbolic size as well
    # (measured: the same time per step).
    # NOTE: each compiled function runs its own copy of the code under its own name. Dynamo keeps
    # its cache and recompile limit (8) per code object, and its automatic-dynamic memory per
    # (file, line, name): with one shared name, a second format's different extra_bits turned the
    # shift amounts into run-time values (slower C++; Triton refused to compile the 64-bit result).
    # Each copy only ever sees one set of integer options, so they stay compile-time constants.
    k = (dynamic, device_type, key, tuple(sorted((n, v if n != "options" else tuple(sorted(v.items())))
                                                 for n, v in static.items())))
    if k not in _COMPILED:
        code = packed_update.__code__.replace(co_name=f"packed_update_{len(_COMPILED)}")
        fn = types.FunctionType(code, packed_update.__globals__, code.co_name, packed_update.__defaults__,
                                packed_update.__closure__)
        fn.__kwdefaults__ = packed_update.__kwdefaults__
        options = _cuda_eager_numerics() if device_type == "cuda" else None
        # NOTE: dynamic=True would also make the integer options symbolic; only lengths are marked.
        compiled = torch.compile(fn, dynamic=None if dynamic else False, options=options)

        def call(half, grad, extra, states, coef, rng_key):
            if dynamic:
                for t in (half, grad, *([extra] if torch.is_tensor(extra) else extra), *states):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            return compiled(half, grad, extra, states, coef, rng_key, **static)

        _COMPILED[k] = call
    return _COMPILED[k]
