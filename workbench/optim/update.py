"""The elementwise update behind the packed optimizers: merge, fp32 step, split (paper 004, 3.1).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (004), section 3.1.
``packed_update`` reconstructs the fp32 master value from the 16-bit parameter and its packed
extra bits, applies torch.optim.SGD's or Adam(W)'s update in fp32 and splits the result back. It
runs eagerly (in chunks, per parameter or over a fused flat stream) or ``torch.compile``d into one
kernel; both paths give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.optim.bits import merge_values, pack, packed_words, split_values, storage_bits, unpack

__all__ = ["CHUNK", "packed_update", "chunked_update", "compiled_update", "sgd_math", "adam_math"]

# NOTE: the eager path updates large parameters in chunks of this many values (a multiple of 32,
# so chunks start on word boundaries) to bound the fp32/int temporaries a step allocates; the
# paper's CUDA kernel has none, and Fig 2 measures peak memory.
CHUNK = 1 << 15


def sgd_math(master, g, states, coef, *, momentum: bool, nesterov: bool, first: bool):
    """torch.optim.SGD's update on the fp32 master value; coef = [lr, wd, mom, 1 - dampening]."""
    g = g + coef[1] * master
    if momentum:
        (buf,) = states
        if first:
            buf.copy_(g)
        else:
            buf.mul_(coef[2]).add_(coef[3] * g)
        g = g + coef[2] * buf if nesterov else buf
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
    exp_avg.mul_(coef[8]).add_(g * coef[2])
    exp_avg_sq.mul_(coef[3]).add_(g * g * coef[4])
    denom = _sqrt(exp_avg_sq) / coef[5] + coef[6]
    return master - coef[7] * (exp_avg / denom)


def packed_update(
    half: torch.Tensor,
    grad: torch.Tensor,
    words: torch.Tensor,
    states: list[torch.Tensor],
    coef: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    math_fn: Callable,
    extra_bits: int,
    stochastic_rounding: bool,
    options: dict[str, Any],
) -> None:
    """One in-place update of 1-D ``half`` (and its packed ``words``/``states``): merge, step, split.

    ``half``'s first value must sit on a 32-value boundary of the packed stream.
    """
    bits = storage_bits(extra_bits, stochastic_rounding)
    values = unpack(words, bits, half.numel())
    master = merge_values(half, values, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding)
    master = math_fn(master, grad.float(), states, coef, **options)
    new_half, new_values = split_values(
        master, dtype=half.dtype, extra_bits=extra_bits,
        stochastic_rounding=stochastic_rounding, noise=noise,
    )
    half.copy_(new_half)
    words.copy_(pack(new_values, bits))


def chunked_update(half, grad, words, states, coef, noise, *, bits, **kw) -> None:
    n = half.numel()
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        ws = s * bits // 32
        packed_update(
            half[s:e], grad[s:e], words[ws : ws + packed_words(e - s, bits)],
            [t[s:e] for t in states], coef, None if noise is None else noise[s:e], **kw,
        )


_COMPILED: dict[str, Callable] = {}


def compiled_update() -> Callable:
    """The process-wide ``torch.compile``d :func:`packed_update` (compiled on first call)."""
    # NOTE: static shapes (dynamic=False): every (group size, format) gets its own specialised,
    # vectorised kernel. Automatic dynamic shapes, torch's default after a recompile, made later
    # formats' kernels several times slower on CPU. Past dynamo's recompile limit a call runs the
    # same function eagerly, which gives the same bits.
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(packed_update, dynamic=False)
    return _COMPILED["fn"]
