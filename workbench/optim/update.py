"""The elementwise update behind the packed optimizers: merge, fp32 step, split (Lewandowski & Kosson, 3.1).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1.
``packed_update`` reconstructs the fp32 master value from the 16-bit parameter and its extra bits
(dense int32 words, or uint8 byte planes for 8- and 16-bit widths), applies torch.optim.SGD's or
Adam(W)'s update in fp32 and splits the result back. It runs eagerly (in chunks, per parameter or
over a fused flat stream) or ``torch.compile``d into one loop; both paths give the same bits.

Randomness (stochastic rounding of the 16-bit value, stochastic master rounding) comes from
``bits.hash_noise``: a counter-based hash of (key, index) computed next to each value, so neither
path allocates a noise buffer the size of the tensor.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workbench.optim.bits import (
    decode,
    hash_noise,
    max_extra_bits,
    merge_values,
    packed_words,
    split_values,
    storage_bits,
    store_into,
)

__all__ = ["CHUNK", "packed_update", "chunked_update", "compiled_update", "sgd_math", "adam_math"]

# NOTE: the eager path updates large parameters in chunks of this many values (a multiple of 32,
# so chunks start on word boundaries) to bound the fp32/int temporaries a step allocates; the
# paper's CUDA kernel has none, and Fig 2 measures peak memory.
CHUNK = 1 << 15

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


def sgd_math(master, g, states, coef, *, momentum: bool, nesterov: bool, first: bool):
    """torch.optim.SGD's update on the fp32 master value; coef = [lr, wd, mom, 1 - dampening]."""
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


def adam_math(master, g, states, coef, *, decoupled: bool):
    """torch.optim.Adam(W)'s update.

    coef = [1 - lr*wd, wd, 1 - b1, b2, 1 - b2, sqrt(1 - b2**t), eps, lr / (1 - b1**t), b1].
    """
    exp_avg, exp_avg_sq = states
    if decoupled:
        master = master * coef[0]
    else:
        g = g + coef[1] * master
    # NOTE: written without lerp_ (eager CPU lerp rounds differently from inductor's code) so the
    # compiled and eager paths give the same bits. Same formula as torch's AdamW, so parity holds
    # to a few fp32 ulps.
    m = _keep(exp_avg, exp_avg.float() * coef[8] + g * coef[2])
    v = _keep(exp_avg_sq, exp_avg_sq.float() * coef[3] + g * g * coef[4])
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
    offset: int = 0,
) -> None:
    """One in-place update of 1-D ``half`` (and its ``extra`` bits and ``states``): merge, step, split.

    ``extra`` is int32 words (``half``'s first value on a 32-value boundary of the packed stream)
    or a list of 1-D uint8 byte planes. ``key`` seeds the per-element random bits (needed with
    stochastic rounding or ``master_rounding="stochastic"``); ``offset`` is the index of
    ``half[0]`` in the stream the key numbers.
    """
    bits = storage_bits(extra_bits, stochastic_rounding)
    n = half.numel()
    values = decode(extra, bits, n)
    master = merge_values(half, values, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding)
    master = math_fn(master, grad.float(), states, coef, **options)
    noise = master_noise = None
    if stochastic_rounding or master_rounding == "stochastic":
        if key is None:
            raise ValueError("stochastic rounding needs a random key")
        h = hash_noise(n, key, offset, device=half.device)
        if stochastic_rounding:
            noise = (h >> 16) & ((1 << max_extra_bits(half.dtype)) - 1)
        if master_rounding == "stochastic":
            master_noise = h
    new_half, new_values = split_values(
        master, dtype=half.dtype, extra_bits=extra_bits,
        stochastic_rounding=stochastic_rounding, noise=noise, master_noise=master_noise,
    )
    half.copy_(new_half)
    store_into(extra, new_values, bits)


def chunked_update(half, grad, extra, states, coef, key, *, bits: int, **kw) -> None:
    """:func:`packed_update` over CHUNK-value slices (bounded temporaries, same bits)."""
    n = half.numel()
    planes = isinstance(extra, list | tuple)
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        if planes:
            ex = [pl[s:e] for pl in extra]
        else:
            ws = s * bits // 32
            ex = extra[ws : ws + packed_words(e - s, bits)]
        packed_update(half[s:e], grad[s:e], ex, [t[s:e] for t in states], coef, key, offset=s, **kw)


_COMPILED: dict[tuple, Callable] = {}


def compiled_update(*, dynamic: bool = False, key: tuple = ()) -> Callable:
    """A process-wide ``torch.compile``d :func:`packed_update`, one per ``(dynamic, key)``.

    ``dynamic=False`` (the fused flat step with dense words): every (group size, format) gets its
    own specialised kernel. ``dynamic=True`` (byte planes, and the per-parameter step inside
    backward): one kernel per format serves every size, so a model's many shapes do not each
    compile. ``key`` names the format (bits, rounding, dtypes), see ``PackedOptimizer``.
    """
    # NOTE: static shapes for dense words: automatic dynamic shapes, torch's default after a
    # recompile, made the dense-packing kernels several times slower on CPU (indexed loads). Byte
    # planes are pure elementwise code, which inductor vectorises with a symbolic size as well
    # (measured: the same time per step).
    # NOTE: dynamo keeps its cache and recompile limit (8) per code object, so each format gets a
    # copy of the function's code: formats do not evict each other or run into the limit, past
    # which a call would run eagerly (the same bits, many times slower).
    k = (dynamic, key)
    if k not in _COMPILED:
        fn = types.FunctionType(packed_update.__code__.replace(), packed_update.__globals__, packed_update.__name__,
                                packed_update.__defaults__, packed_update.__closure__)
        fn.__kwdefaults__ = packed_update.__kwdefaults__
        _COMPILED[k] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[k]
