"""Dense packing of k-bit values into int32 words (Fig 1), and byte planes for 8- and 16-bit widths.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 and Fig 1
("the extra storage is created and accessed using twelve 32-bits integers, the bits stored ... are
distributed among 32 slots").

Packing (:func:`pack`, :func:`unpack`): values of ``w`` bits are stored LSB-first in consecutive
int32 words, a value straddling a word boundary continues in the low bits of the next word; n values
take ``ceil(n * w / 32)`` words (:func:`packed_words`) and no bit is wasted.

Byte planes (``aligned=True`` in :func:`encode`, widths 8 and 16 only): the value's byte j is stored
in plane j of a ``(w // 8, n)`` uint8 tensor, so merge and split are pure elementwise shifts that a
compiler vectorises, at the same density (1 or 2 bytes per value) as the dense words.
"""

from __future__ import annotations

import torch

__all__ = [
    "decode",
    "encode",
    "extra_storage",
    "is_byte_aligned",
    "pack",
    "packed_words",
    "store_into",
    "unpack",
]


def packed_words(n: int, bits: int) -> int:
    """int32 words holding n values of ``bits`` bits densely: ceil(n * bits / 32)."""
    return (n * bits + 31) // 32


def is_byte_aligned(bits: int) -> bool:
    """True for storage widths kept as byte planes (8 and 16 bits) rather than dense words."""
    return bits in (8, 16)


def extra_storage(n: int, bits: int, *, aligned: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the extra bits of n values: byte planes (w // 8, n) uint8, or int32 words."""
    if aligned and is_byte_aligned(bits):
        return (bits // 8, n), torch.uint8
    return (packed_words(n, bits),), torch.int32


def _layout(bits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Where each of the 32 values of a block (which fills exactly ``bits`` words) lands."""
    off = torch.arange(32, device=device, dtype=torch.int64) * bits
    lo, shift = off // 32, off % 32
    spill = (shift + bits) > 32
    hi = torch.where(spill, lo + 1, lo)
    return lo, shift, hi, spill


def _to_int32(words64: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement wrap)."""
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the low ``bits`` bits of each integer in ``values`` into ceil(n*bits/32) int32 words."""
    if not 0 <= bits <= 32:
        raise ValueError(f"bits={bits} out of range: allowed 0..32")
    values = values.reshape(-1)
    n = values.numel()
    nwords = packed_words(n, bits)
    if bits == 0:
        return torch.zeros(0, dtype=torch.int32, device=values.device)
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        # NOTE: when the width divides 32 no value straddles two words: word j is the OR of its
        # 32/bits values shifted into place; int32-only arithmetic keeps inductor's kernels
        # vectorized (it does not vectorize int16).
        per = 32 // bits
        v = values.to(torch.int32) & mask
        if n % per:
            v = torch.cat([v, v.new_zeros(per - n % per)])
        v = v.view(-1, per)
        words = v[:, 0]
        for j in range(1, per):
            words = words | (v[:, j] << (j * bits))
        return words
    blocks = (n + 31) // 32
    v = torch.zeros(blocks * 32, dtype=torch.int64, device=values.device)
    v[:n] = values.to(torch.int64) & mask
    v = v.view(blocks, 32)
    lo, shift, hi, spill = _layout(bits, values.device)
    low_part = (v << shift) & 0xFFFFFFFF
    high_part = torch.where(spill, v >> (32 - shift), torch.zeros_like(v))
    # NOTE: the pieces never overlap, so adding them is the same as OR-ing them.
    words = torch.zeros(blocks, bits, dtype=torch.int64, device=values.device)
    words.index_add_(1, lo, low_part)
    words.index_add_(1, hi, high_part)
    return _to_int32(words.view(-1)[:nwords])


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: n unsigned values of ``bits`` bits as int32."""
    if not 0 <= bits <= 32:
        raise ValueError(f"bits={bits} out of range: allowed 0..32")
    if words.dtype != torch.int32 or words.numel() != packed_words(n, bits):
        raise ValueError(
            f"expected {packed_words(n, bits)} int32 words for n={n}, bits={bits}; "
            f"got {words.numel()} of {words.dtype}"
        )
    if bits == 0:
        return torch.zeros(n, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        if torch.compiler.is_compiling():
            # NOTE: an indexed load fuses into the consumer's loop; eagerly it would allocate
            # int64 indices, so eager code unpacks with whole-tensor shifts instead.
            i = torch.arange(n, device=words.device)
            return (words[i // per] >> ((i % per) * bits).to(torch.int32)) & mask
        parts = [(words >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, dim=1).view(-1)[:n]
    blocks = (n + 31) // 32
    w = torch.zeros(blocks * bits, dtype=torch.int64, device=words.device)
    w[: words.numel()] = words.to(torch.int64) & 0xFFFFFFFF
    w = w.view(blocks, bits)
    lo, shift, hi, spill = _layout(bits, words.device)
    v = w[:, lo] >> shift
    v = v | torch.where(spill, w[:, hi] << (32 - shift), torch.zeros_like(v))
    return (v & mask).view(-1)[:n].to(torch.int32)


# NOTE: byte planes rather than one int16 per value: inductor's C++ backend does not vectorise
# int16 (torch 2.13, VECTORIZABLE_DTYPES), but vectorises uint8 loads/stores, so two uint8 planes
# hold the same 2 bytes per value and keep the fused update one vectorised loop. Planes are passed
# to the compiled update as separate 1-D views, which inductor writes in the same loop.
def encode(values: torch.Tensor, bits: int, *, aligned: bool) -> torch.Tensor:
    """Store n unsigned ``bits``-bit values: byte planes when aligned and 8/16 bits, else :func:`pack`."""
    if aligned and is_byte_aligned(bits):
        v = values.reshape(-1).to(torch.int32)
        return torch.stack([((v >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(bits // 8)])
    return pack(values, bits)


def decode(store: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`encode`: n values as int32, from byte planes (uint8) or packed words (int32)."""
    if isinstance(store, list | tuple) or store.dtype == torch.uint8:
        planes = list(store)
        if len(planes) != bits // 8 or not is_byte_aligned(bits) or any(p.numel() != n for p in planes):
            raise ValueError(f"expected {bits // 8} byte planes of {n} values for bits={bits}")
        out = planes[0].reshape(-1).to(torch.int32)
        for j in range(1, len(planes)):
            out = out | (planes[j].reshape(-1).to(torch.int32) << (8 * j))
        return out
    return unpack(store, bits, n)


def store_into(store: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
               values: torch.Tensor, bits: int) -> None:
    """Write n values in place into byte planes (a list of 1-D uint8 views, or a 2-D uint8) or words."""
    if isinstance(store, list | tuple) or store.dtype == torch.uint8:
        for j, plane in enumerate(store):
            plane.copy_(((values >> (8 * j)) & 0xFF).to(torch.uint8).view_as(plane))
    else:
        store.copy_(pack(values, bits))
