"""8-bit optimizer moments (``state_dtype=torch.int8``): codes in groups of 32 values with one bf16 scale each.

Beyond the paper (Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 keeps
fp32 moments); issue 46. The idea of block-wise 8-bit moments is Dettmers et al., "8-bit Optimizers via
Block-wise Quantization" (2022), and FlashOptim's groups of 32 with a scale each; the companding maps here
were chosen by measurement (NOTE below) and the code is our own.

A moment is held as codes (one byte per value, along the parameter in its memory order) and one scale per
group of 32 consecutive values (the last group of a parameter may be shorter; it is quantized as if padded
with zeros). The scale ``s`` is the group's largest magnitude rounded to the nearest bf16 value; codes are
computed against it (and clipped to the code range, which a value at most 2**-8 above ``s`` cannot leave by
more than rounding). A step dequantizes a chunk to fp32, runs the ordinary fp32 update and requantizes what it
keeps: eagerly (``update.packed_update``), ``torch.compile``d, or in the C++ CPU kernel (``csrc/packed_int8.h``),
all bit for bit the same; the Triton kernel does not take them yet (on CUDA: the compiled or the eager update).
The error bound, derived in ``tests/optim/test_int8_moments.py``: ``|x' - x| <= sqrt(|x| s) / L + s / (4 L**2)``.

- ``"signed"`` (first moment, SGD momentum; int8 codes -127..127): sqrt companding,
  ``c = sign(x) * round(sqrt(|x| / s * 127**2))``, read back as ``x' = c * |c| * (s / 127**2)``.
- ``"square"`` (second moment, non-negative; uint8 codes 0..255): its square root ``w = sqrt(v)`` with sqrt
  companding, ``c = round(sqrt(w / s * 255**2))`` with ``s`` the group's largest ``w``, read back as
  ``v' = (c * c * (s / 255**2))**2``: v**(1/4) linear.

# NOTE: chosen by measurement (``tests/optim/test_int8_moments.py::test_companding_choice`` re-measures the
# first moment's rows on a trained MLP). AdamW moments of an embedding + 3-layer MLP trained on
# random data (2 seeds, steps 5/50/300, 91k values each), error of the update m/(sqrt(v)+eps) with one
# moment quantized, ||du|| / ||u|| mean (worst), and the largest |du| over the update's rms:
#   first moment:  linear 0.0076 (0.039), max 1.07;   softsign 2x/(1+|x|) 0.0064 (0.025), max 0.95;
#                  sqrt 0.0066 (0.010), max 0.17;     cube root 0.0084 (0.011), max 0.08.
#   second moment: v linear 0.77 (12.0), max 2.4e3, 2% of v > 0 read back as 0 (the update is then m/eps);
#                  sqrt(v) linear 0.0038 (0.043), max 2.9, 0.07% lost to 0;
#                  sqrt(v) softsign 0.0029 (0.010), max 0.88, 0.04% lost to 0;
#                  sqrt(v) sqrt-companded 0.0031 (0.0047), max 0.065, none lost to 0.
# sqrt companding has the smallest worst case for both (small values keep a code: for v, a value down to
# s**2 / 255**4 = 2.3e-10 of the group's largest stays nonzero, so a denominator never collapses to eps).
# NOTE: the scale is bf16, not fp16: fp16's range ends at 6e-8 (subnormals from 6e-5 lose bits), and a
# sqrt(v) or momentum of a parameter with small gradients lies below it, so a whole group would read back as
# zero; bf16 has fp32's range. Its 8-bit mantissa costs the group's largest value at most 2**-9 of itself (it
# reads back as ``s``), under half of the top code's own half-step (1/L of ``s`` with sqrt companding).
# NOTE: codes round to nearest, so an EMA increment below half a code is lost: with beta2 = 0.999 the second
# moment holds its value where torch's would drift by under ~1.6% (one code near the top), and a group
# whose gradients stop keeps its scale (the maximum decayed by sqrt(beta2) rounds back to the same bf16 scale). That
# makes the denominator an over-estimate, never zero: the update is smaller, not larger.
# NOTE: a group holding NaN or inf (or a magnitude above bf16's largest finite value, 3.39e38) reads back as
# NaN everywhere, as the parameter would be after torch's step; -0.0 reads back as +0.0.
"""

from __future__ import annotations

import torch

__all__ = ["GROUP", "KINDS", "LEVELS", "code_dtype", "dequantize", "dequantize_states", "expected_states", "kind_of",
           "new_quantized", "quantize", "quantize_states", "refuse_sharded", "scale_key", "scales_for", "slice_states",
           "stored_keys"]

GROUP = 32
#: code range per kind: signed int8 -127..127, unsigned uint8 0..255
LEVELS = {"signed": 127, "square": 255}
KINDS = tuple(LEVELS)
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def kind_of(key: str) -> str:
    """``"square"`` for a second moment (non-negative, kept as its square root), ``"signed"`` otherwise."""
    return "square" if key in _SECOND_MOMENTS else "signed"


def code_dtype(kind: str) -> torch.dtype:
    return torch.uint8 if kind == "square" else torch.int8


def scale_key(key: str) -> str:
    """The state holding the bf16 scales of quantized state ``key``."""
    return f"{key}_scale"


def stored_keys(keys: tuple[str, ...] | list[str]) -> list[str]:
    """The state entries the int8 moments ``keys`` are kept in: codes and scales, in pairs."""
    return [name for k in keys for name in (k, scale_key(k))]


def scales_for(n: int) -> int:
    """Number of groups (scales) of ``n`` values."""
    return (n + GROUP - 1) // GROUP


def new_quantized(n: int, key: str, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero codes (1-D, ``n`` values in the parameter's memory order) and zero scales for state ``key``, made like
    ``like`` (the parameter: its device, and a fake tensor under a plan's trace, where a factory of integers runs
    for real: ``calcgraph.values``)."""
    return {key: like.new_zeros(n, dtype=code_dtype(kind_of(key))),
            scale_key(key): like.new_zeros(scales_for(n), dtype=torch.bfloat16)}


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    # correctly rounded fp32 square root on both paths (eager CPU fp32 sqrt is not always; see ``update._sqrt``;
    # compiled, the float64 detour would be fused away and the rounding to a code would see the float64 root)
    if torch.compiler.is_compiling():
        return x.sqrt()
    return x.double().sqrt().float()


def _round_bf16(a: torch.Tensor) -> torch.Tensor:
    """fp32 ``a`` >= 0 rounded to the nearest bf16 value, ties to even (as fp32; NaN stays NaN, overflow is inf).

    # NOTE: in integer arithmetic, as ``.to(torch.bfloat16).float()`` computes it: inductor drops that round trip
    # (the compiled step would compute codes against the unrounded scale and store the rounded one).
    """
    bits = a.view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(a.isnan(), a, rounded)


def _parts(n: int) -> list[tuple[int, int]]:
    """(start, end) of the full groups of ``n`` values and of the short last group, each as a 2-D view's rows.

    # NOTE: the short group is viewed as one row of its own length rather than zero-padded to 32: the same
    # values (zeros change no maximum), and torch.compile (2.13, CPU) dropped the padded row's stores when a
    # padded reduction was sliced back and copied out."""
    full = n // GROUP * GROUP
    return [(a, b) for a, b in ((0, full), (full, n)) if b > a]


def _rows(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x[a:b].view(-1, GROUP) if (b - a) % GROUP == 0 else x[a:b].view(1, -1)


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: str) -> None:
    """Store fp32 1-D ``x`` (for ``"square"``: the second moment v >= 0) into ``codes`` and ``scales``.

    ``codes`` has ``x.numel()`` values, ``scales`` one per group of 32 (``scales_for``)."""
    levels = LEVELS[kind]
    x = x.float()
    y = _sqrt(x) if kind == "square" else x
    for a, b in _parts(x.numel()):
        g = _rows(y, a, b)
        mag = g.abs()
        s = _round_bf16(mag.amax(dim=1, keepdim=True))  # |x| / s <= 1 + 2**-8
        t = mag / torch.where(s > 0, s, torch.ones_like(s))  # a zero or NaN scale divides by 1
        c = torch.round(_sqrt(t * float(levels * levels))).clamp_(max=levels).nan_to_num_(0.0)
        if kind == "signed":
            c = torch.where(g < 0, -c, c)
        _rows(codes, a, b).copy_(c)
        scales[a // GROUP : scales_for(b)].copy_(s.view(-1))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 values ``codes`` and ``scales`` hold (for ``"square"``: the second moment v)."""
    levels = LEVELS[kind]
    parts = []
    for a, b in _parts(codes.numel()):
        c = _rows(codes, a, b).float()
        step = scales[a // GROUP : scales_for(b)].float().view(-1, 1) / float(levels * levels)  # once per group
        x = (c * c.abs()) * step
        parts.append((x * x if kind == "square" else x).view(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else codes.float()


def dequantize_states(states: list[torch.Tensor], kinds: tuple[str, ...]) -> list[torch.Tensor]:
    """(codes, scales) pairs, one per kind, as fp32 tensors."""
    return [dequantize(states[2 * i], states[2 * i + 1], kind) for i, kind in enumerate(kinds)]


def quantize_states(values: list[torch.Tensor], states: list[torch.Tensor], kinds: tuple[str, ...]) -> None:
    for i, kind in enumerate(kinds):
        quantize(values[i], states[2 * i], states[2 * i + 1], kind)


def slice_states(states: list[torch.Tensor], kinds: tuple[str, ...], start: int, end: int) -> list[torch.Tensor]:
    """The (codes, scales) pairs of values ``start:end`` (``start`` a multiple of 32)."""
    if start % GROUP:
        raise ValueError(f"a slice of 8-bit moments starts on a group boundary (a multiple of {GROUP}), not {start}")
    out = []
    for i in range(len(kinds)):
        out += [states[2 * i][start:end], states[2 * i + 1][start // GROUP : scales_for(end)]]
    return out


def expected_states(n: int, keys: tuple[str, ...] | list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What a state dict holds for the int8 moments ``keys`` of an ``n``-value parameter: key -> (shape, dtype)."""
    out = {}
    for k in keys:
        out[k] = ((n,), code_dtype(kind_of(k)))
        out[scale_key(k)] = ((scales_for(n),), torch.bfloat16)
    return out


def refuse_sharded(where: str) -> None:
    """ValueError: 8-bit moments are not kept for FSDP2 (DTensor) parameters (yet)."""
    raise ValueError(
        f"{where} is a DTensor (FSDP2) and state_dtype=torch.int8: 8-bit moments keep one scale per 32 values "
        "along the parameter, which do not follow a shard's boundaries through torch.distributed.checkpoint's "
        "resharding, so they are not supported for sharded parameters yet; use state_dtype=torch.bfloat16 "
        "(or torch.float32) with FSDP2")
