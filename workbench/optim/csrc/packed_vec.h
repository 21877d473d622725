// Vector helpers of the packed CPU step (packed_step.cpp): float <-> 16-bit patterns, and fp32 arithmetic
// with the eager step's exact results (ATen's NaN rules, torch's sqrt, a correctly rounded division by a
// per-step constant); the loads and stores are in packed_io.h. See packed_step.cpp for the paper and why.
#pragma once

#include <cmath>
#include <cstdint>

#include "packed_io.h"

namespace workbench_packed {

// ------------------------------------------------------------------------ bit-level helpers
inline ivec I(int32_t v) { return ivec(v); }
inline fvec as_float(const ivec& v) { return at::vec::cast<float>(v); }
inline ivec as_int(const fvec& v) { return at::vec::cast<int32_t>(v); }
// where(mask, a, b) for masks of all-ones / all-zeros lanes
inline ivec select(const ivec& mask, const ivec& a, const ivec& b) { return b ^ ((a ^ b) & mask); }
inline ivec sign_mask(const ivec& v) { return v >> I(31); }  // -1 where v < 0
// whether every lane of a mask (all-ones / all-zeros lanes) is set
inline bool all_lanes(const ivec& mask) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_movepi32_mask(mask) == 0xFFFF;
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_movemask_ps(_mm256_castsi256_ps(mask)) == 0xFF;
#else
  alignas(64) int32_t b[kLanes];
  mask.store(b);
  for (int j = 0; j < kLanes; j++) {
    if (b[j] == 0) return false;
  }
  return true;
#endif
}

// NOTE: ATen's add and sub kernels compute self + alpha * other as fmadd(other, alpha, self): where
// both operands are NaN the result is `other`'s NaN (quieted, sign kept), where x86's vaddps/vsubps
// would return `self`'s. The eager step's NaN payloads (so the bits of a NaN master value's half and
// extra bits) follow ATen's rule; these two helpers keep it.
inline fvec nan_from_other(const fvec& r, const fvec& other) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 nan = _mm512_cmp_ps_mask(other, other, _CMP_UNORD_Q);
  return _mm512_mask_or_ps(r, nan, other, _mm512_castsi512_ps(_mm512_set1_epi32(0x400000)));
#else
  return fvec::blendv(r, other | as_float(ivec(0x400000)), other.isnan());
#endif
}

// self + other and self - other with ATen's NaN rule. On AVX512 the instruction's operand order
// gives the rule for free (x86 returns the first source's NaN; the compiler may swap the operands of a
// plain `+`, not of an asm statement): vaddps with `other` first, and ATen's own fmadd(other, -1,
// self) for the difference (an FMA returns its first NaN operand; checked against torch for every
// pair of NaN, number and signalling NaN).
inline fvec add_t(const fvec& self, const fvec& other) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r;
  asm("vaddps %[s], %[o], %[r]"
      : [r] "=v"(r)
      : [s] "v"(static_cast<__m512>(self)), [o] "v"(static_cast<__m512>(other)));
  return r;
#else
  return nan_from_other(self + other, other);
#endif
}
inline fvec sub_t(const fvec& self, const fvec& other) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 o = other;
  asm("vfmadd132ps %[m], %[s], %[o]"
      : [o] "+v"(o)
      : [s] "v"(static_cast<__m512>(self)), [m] "v"(_mm512_set1_ps(-1.0f)));
  return o;
#else
  return nan_from_other(self - other, other);
#endif
}

// torch's sqrt (Sleef) returns +NaN (0x7FC00000) for a negative input where x86's vsqrtps gives the
// default NaN 0xFFC00000; NaN inputs keep their payload and -0 stays -0 in both.
inline fvec sqrt_t(const fvec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  // a masked square root: +NaN where v < 0, merged in by the sqrt itself (no separate blend)
  const __mmask16 not_negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NLT_UQ);
  return _mm512_mask_sqrt_ps(_mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)), not_negative, v);
#else
  return fvec::blendv(v.sqrt(), as_float(ivec(0x7FC00000)), v < fvec(0.0f));
#endif
}

// x / c for a divisor c known per step (Adam's sqrt(1 - beta2**t)), correctly rounded without the
// divider: with y = RN(1/c), q = RN(x * y), r = x - c * q (exact, one FMA), RN(q + r * y) is RN(x / c)
// for every x (Markstein's theorem; division by a constant, Brisebarre, Muller & Raina 2004), checked
// against vdivps over every x significand for 10^4 divisors (markstein_check.cpp). Zeros, infinities
// and NaNs take RN(x * y), which equals x / c there for 0 < c <= 1. NOTE: the divider (sqrt and two
// divisions per vector) bounds the in-cache step; this moves one division to the FMA ports.
struct DivideByConstant {
  fvec c, y;
};
// kExact: c is a positive normal number <= 1 (else: plain division); a template parameter, so the loop has
// no branch on it.
template <bool kExact>
inline fvec divide(const fvec& x, const DivideByConstant& d) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (kExact) {
    const fvec q = x * d.y;
#if defined(CPU_CAPABILITY_AVX512)
    // r = x - c * q in one fnmadd (-(q * c) + x: the same single rounding as fmadd(-q, c, x)), and the
    // correction q + r * y merged with the special lanes' q by the FMA's own mask (0x9F: NaN, +-0, +-inf)
    const fvec r = _mm512_fnmadd_ps(q, d.c, x);
    return _mm512_mask3_fmadd_ps(r, d.y, q, static_cast<__mmask16>(~_mm512_fpclass_ps_mask(x, 0x9F)));
#else
    const fvec r = _mm256_fnmadd_ps(q, d.c, x);
    const fvec fine = at::vec::fmadd(r, d.y, q);
    const fvec special = (x == fvec(0.0f)) | (x.abs() < fvec(INFINITY)) ^ as_float(ivec(-1));
    return fvec::blendv(fine, q, special);
#endif
  }
#endif
  return x / d.c;
}

// fp32 -> bf16 in the upper half of each lane (the lower half is don't-care for store_u16_hi), round
// to nearest even, as the eager step's copy_ into bf16 states rounds: NaN -> 0xFFFF in ATen's AVX2 and
// AVX512 conversion, 0x7FC0 in c10's scalar one (which generic builds mirror).
inline ivec float_to_bf16_hi(const fvec& x) {
  const ivec u = as_int(x);
#if defined(CPU_CAPABILITY_AVX512)
  // u + 0x7FFF, plus 1 where bit 16 (the bf16 value's last bit) is set: a test into a mask and a
  // masked add, one instruction fewer than shift, and, add
  const ivec half_up = u + I(0x7FFF);
  const ivec r = _mm512_mask_add_epi32(half_up, _mm512_test_epi32_mask(u, I(0x10000)), half_up, I(1));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(-65536));
#else
  const ivec r = ((u >> I(16)) & I(1)) + I(0x7FFF) + u;
#if defined(CPU_CAPABILITY_AVX2)
  return select(sign_mask(I(0x7F800000) - (u & I(0x7FFFFFFF))), I(-65536), r);
#else
  return select(sign_mask(I(0x7F800000) - (u & I(0x7FFFFFFF))), I(0x7FC00000), r);
#endif
#endif
}

// kLanes fp32 values stored as bf16, rounded to nearest even as float_to_bf16_hi rounds them. NOTE: with
// AVX512-BF16 (cpu_kernel.py adds -mavx512bf16 where the CPU has it) one vcvtneps2bf16 converts and packs
// them (6 vector ops fewer per stored state); it flushes subnormal inputs to zero and returns another NaN
// than ATen's conversion, so a vector holding either takes the integer rounding.
inline void store_bf16(uint16_t* p, const fvec& x) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (_mm512_fpclass_ps_mask(x, 0xA1) == 0) {  // 0xA1: quiet NaN, subnormal, signalling NaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    return;
  }
#endif
  store_u16_hi(p, float_to_bf16_hi(x));
}

// bits | 0x400000 where x is a NaN: the quiet bit of fp32 is bf16's bit 0x40, which split sets on a
// NaN whose payload may sit in dropped bits. NOTE: x86 arithmetic never returns a signalling NaN, so
// on AVX2/AVX512 builds a value that comes out of an arithmetic instruction needs no quieting
// (kArithmeticQuiets); generic builds (maybe not x86) quiet it here.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kArithmeticQuiets = true;
#else
constexpr bool kArithmeticQuiets = false;
#endif
inline ivec quiet_if_nan(const ivec& bits, const fvec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_or_epi32(bits, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x400000));
#else
  return bits | (sign_mask(I(0x7F800000) - (bits & I(0x7FFFFFFF))) & I(0x400000));
#endif
}

// bits + r where |x| + r (the fp32 pattern's magnitude plus r) stays below inf's pattern, else bits:
// split_merge's master rounding with its finite-and-stays-finite test, read as one unsigned compare
// (a NaN's |x| + r may wrap past 2**31: unsigned, it still reads as >= inf)
inline ivec add_below_inf(const ivec& bits, const ivec& r) {
  const ivec sum = (bits & I(0x7FFFFFFF)) + r;
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_mask_add_epi32(bits, _mm512_cmplt_epu32_mask(sum, I(0x7F800000)), bits, r);
#else
  const ivec finite = (sum ^ I(INT32_MIN)) < I(0x7F800000 ^ INT32_MIN);  // -1 lanes: unsigned sum < inf
  return bits + (r & finite);
#endif
}

// rng.hash_noise: murmur3's finaliser (hash_mix) over index * golden ratio + key (hash_seed), int32 and
// wrapping; hash_seed of the kLanes indices first, first + 1, ... (the vector of one block)
constexpr uint32_t kGolden = 0x9E3779B1u;  // -1640531535 as int32
inline ivec hash_seed(int32_t first, int32_t key) {
  alignas(64) static constexpr int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(kLanes <= 16, "iota covers 16 lanes");
  // NOTE: not ivec::arange(first, 1), which builds the vector lane by lane from scalars
  return (I(first) + ivec::loadu(iota)) * I(static_cast<int32_t>(kGolden)) + I(key);
}

inline ivec hash_mix(ivec h) {
  h = h ^ ((h >> I(16)) & I(0xFFFF));
  h = h * I(-2048144789);
  h = h ^ ((h >> I(13)) & I(0x7FFFF));
  h = h * I(-1028477387);
  return h ^ ((h >> I(16)) & I(0xFFFF));
}

// split_merge._compose: (16-bit pattern, full-width remainder) -> fp32
template <bool kFp16>
inline fvec compose(const ivec& hb, const ivec& low) {
  if constexpr (!kFp16) {
    return as_float((hb << I(16)) | low);
  } else {
    const ivec sign = (hb & I(0x8000)) << I(16);
    const ivec e = hb & I(0x7C00);
    const ivec normal_mag = (((hb & I(0x7FFF)) << I(13)) + I(112 << 23)) | low;
    // NOTE: a vector of fp16 normal numbers (the common case) skips the subnormal and special lanes
    if (all_lanes((e > I(0)) & (e < I(0x7C00)))) return as_float(sign | normal_mag);
    ivec frac = hb & I(0x3FF);
    ivec q = (frac << I(13)) | low;
    ivec small_mag = as_int(at::vec::convert_to_fp_of_same_size<float>(q) * fvec(0x1p-37f));
    ivec nonzero_frac = (frac == I(0)) ^ I(-1);
    ivec special_mag = I(0x7F800000) | (nonzero_frac & (I(0x400000) | (frac << I(13))));
    ivec mag = select(e == I(0), small_mag, select(e == I(0x7C00), special_mag, normal_mag));
    return as_float(sign | mag);
  }
}

// split_merge._fields: fp32 -> (16-bit pattern truncated toward zero, full-width remainder)
template <bool kFp16>
inline void fields(const fvec& x, ivec& hb, ivec& low) {
  ivec bits = as_int(x);
  if constexpr (!kFp16) {
    hb = (bits >> I(16)) & I(0xFFFF);
    low = bits & I(0xFFFF);
  } else {
    const ivec sign = (bits >> I(16)) & I(0x8000);
    const ivec mag = bits & I(0x7FFFFFFF);
    if (all_lanes((mag >= I(0x38800000)) & (mag < I(0x47800000)))) {  // all in fp16's normal range
      hb = sign | ((mag >> I(13)) - I(112 << 10));
      low = mag & I(0x1FFF);
      return;
    }
    ivec small = mag < I(0x38800000);
    ivec overflow = (mag >= I(0x47800000)) & (mag < I(0x7F800000));
    ivec special = mag >= I(0x7F800000);
    ivec nan = mag > I(0x7F800000);
    // below fp16's normal range: fixed point in units of 2**-37 (exact scaling, truncation);
    // other lanes are overwritten below, whatever their q.
    ivec q = at::vec::convert_to_int_of_same_size<float>(as_float(mag) * fvec(0x1p37f));
    ivec h = select(small, q >> I(13), (mag >> I(13)) - I(112 << 10));
    ivec l = select(small, q & I(0x1FFF), mag & I(0x1FFF));
    h = select(overflow, I(0x7BFF), h);
    l = select(overflow, I(0x1FFF), l);
    ivec special_hb = I(0x7C00) | (nan & (I(0x200) | ((mag >> I(13)) & I(0x3FF))));
    h = select(special, special_hb, h);
    l = select(special, I(0), l);
    hb = sign | h;
    low = l;
  }
}

}  // namespace workbench_packed
