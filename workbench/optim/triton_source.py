"""The Triton source of the packed optimizers' step (``triton_kernel`` compiles or interprets it).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 and Fig 1: one
program merges BLOCK 16-bit values with their extra bits (uint8 byte planes, or k-bit values packed densely
into int32 words), applies AdamW's or SGD's update in fp32 and splits back, with the operations of the
eager step (``update.packed_update``, ``split_merge``, ``rng.hash_noise``) in the same order, each rounded
once. The contract, the launch and the choice of this kernel are in ``workbench.optim.triton_kernel``.
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:  # the module still imports; triton_kernel.available() says False
    tl = None

__all__ = ["step_body"]


# NOTE: one plain function, without helper functions, so the same source runs jit-compiled and
# interpreted (Triton's compiler calls only @triton.jit helpers, its interpreter only interpreted ones).
def step_body(half_ptr, grad_ptr, seg_ptr, x0_ptr, x1_ptr, s0_ptr, s1_ptr, s2_ptr, coef_ptr, key, offset, n,
               IS_BF16: tl.constexpr, EXTRA_BITS: tl.constexpr, SR: tl.constexpr, MASTER_SR: tl.constexpr,
               MATH: tl.constexpr, DECOUPLED: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               FIRST: tl.constexpr, MAXIMIZE: tl.constexpr, AMSGRAD: tl.constexpr, SCALED: tl.constexpr,
               N_COEF: tl.constexpr, STATE_BF16: tl.constexpr, NATIVE_BF16: tl.constexpr, STORE: tl.constexpr,
               WORDS_P2: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK: tl.constexpr, NEAREST: tl.constexpr = False):
    """One program: BLOCK values of the stream (merge, fp32 step, split), in eager's order of operations.

    MATH: 0 Adam(W), 1 SGD. STORE: the extra bits in 0 none, 1 byte planes (x0, x1), 2 dense int32 words
    (x0; WORDS_P2 is the power of two at or above the block's BLOCK * bits / 32 words). SEGMENTED: the gradient
    per segment of a fused group, read where autograd left it: grad_ptr holds the segments' addresses (int64),
    seg_ptr a row per program (its first value, its segment's start, length and index), each block inside one
    segment; else grad_ptr is the flat gradient and program pid takes values pid * BLOCK on. NATIVE_BF16: round
    bf16 states with the device's own conversion (CUDA's cvt.rn), else bit by bit as ATen's vectorised
    CPU conversion (NaN becomes 0xFFFF). NEAREST: ``master_rounding="nearest"`` (never with SR or MASTER_SR): the
    master rounded to nearest at its lowest kept bit, the 16-bit value to nearest over the extra bits.
    """
    FULL: tl.constexpr = 16 if IS_BF16 else 13
    INF: tl.constexpr = 0x7F80 if IS_BF16 else 0x7C00
    DROP: tl.constexpr = FULL - EXTRA_BITS
    BITS: tl.constexpr = EXTRA_BITS + SR
    WORDS: tl.constexpr = BLOCK * BITS // 32  # a block starts and ends on a word boundary
    pid = tl.program_id(0)
    if SEGMENTED:
        # NOTE: the alignment the host guarantees (32-value segment starts, 16-byte gradient addresses) is told
        # to the compiler, which otherwise cannot vectorise loads from addresses read at run time
        # values up to the segment's 32-value end are the flat buffers' (padding included): vector loads and
        # stores; only the gradient ends exactly at the segment's end
        row = seg_ptr + pid * 4
        start = tl.multiple_of(tl.load(row), 32)
        first = tl.multiple_of(tl.load(row + 1), 32)
        end = first + tl.load(row + 2)
        i = start + tl.arange(0, BLOCK)
        live = i < tl.multiple_of((end + 31) // 32 * 32, 32)
        valid = i < end
        grad_at = tl.multiple_of(tl.load(grad_ptr + tl.load(row + 3)).to(tl.pointer_type(tl.int16)), 8)
        if start + BLOCK <= end:
            g16 = tl.load(grad_at + (i - first))
        else:
            g16 = tl.load(grad_at + (i - first), mask=valid, other=0)
    else:
        start = pid * BLOCK
        end = n
        i = start + tl.arange(0, BLOCK)
        live = i < n
        valid = live
        g16 = tl.load(grad_ptr + i, mask=live, other=0).to(tl.int16, bitcast=True)
    words = x0_ptr + (start // 32) * BITS  # dense words: the block's first word (start is a multiple of 32)
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
    if NEAREST and EXTRA_BITS > 0:  # undo the round-up: top extra bit set and the 16-bit value not a NaN
        hb = hb - (((values >> (EXTRA_BITS - 1)) & 1) & (((hb & 0x7FFF) - INF - 1) >> 31))
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
    if IS_BF16:
        g = (g16.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        g = g16.to(tl.float16, bitcast=True).to(tl.float32)
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
    if IS_BF16 and (EXTRA_BITS < FULL or NEAREST):
        nan_bit = ((0x7F800000 - (((hb & 0x7FFF) << 16) | low)) >> 31) & 0x40
    if (MASTER_SR or NEAREST) and EXTRA_BITS < FULL:
        sign = hb & 0x8000
        mag16 = hb & 0x7FFF
        z = (mag16 << FULL) | low
        if MASTER_SR:
            r = h & ((1 << DROP) - 1)
        else:  # nearest: half the lowest kept bit
            r = (hb * 0) + (1 << (DROP - 1))
        ok = ((mag16 - INF) & (((z + r) >> FULL) - INF)) >> 31
        z = z + (r & ok)
        hb = sign | (z >> FULL)
        low = ((z & ((1 << FULL) - 1)) >> DROP) << DROP
    values = low >> DROP
    if IS_BF16 and (EXTRA_BITS < FULL or NEAREST):
        hb = hb | nan_bit
    if NEAREST:  # round the 16-bit value up: first dropped bit set and the pattern finite
        hb = hb + (((low >> (FULL - 1)) & 1) & (((hb & 0x7FFF) - INF) >> 31))
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
        new = tl.where(valid, values, 0).to(tl.uint32, bitcast=True)
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
        n_words = (end // 32) * BITS + ((end % 32) * BITS + 31) // 32  # up to the segment's (stream's) last word
        tl.store(words + w, word.to(tl.int32, bitcast=True), mask=(w < WORDS) & ((start // 32) * BITS + w < n_words))
