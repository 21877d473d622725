// 8-bit moments of the packed CPU step (packed_step.cpp): state_dtype=torch.int8, codes in groups of 32 values
// with one bf16 scale each (workbench/optim/quantized.py holds the format, its measurement and its error bound).
//
// A group is dequantized into 32 fp32 values, stepped by the fp32-state kernel's own block (so merge, update and
// split are the very code the fp32 step runs), and requantized. Every operation mirrors quantized.py's eager
// code in the same order, each rounded once: the dequantizing step s / L**2 (one division per group), c * |c|
// times it (and squared for the second moment); the correctly rounded square root, the division by the rounded
// scale, round half to even, the clip to L, NaN to code 0; the scale rounded to bf16 in integer arithmetic. So
// the result is the eager step's bit for bit (tests/optim/test_int8_moments.py). A short last group (a parameter
// whose size is not a multiple of 32) runs the same code on zero-padded copies and quantizes its own values only.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "packed_vec.h"

#ifndef WB_DIVIDE_PLAIN  // the build variant's define (packed_step.cpp): 1 divides with the divider
#define WB_DIVIDE_PLAIN 0
#endif

namespace workbench_packed {

constexpr int kGroup = 32;
static_assert(kGroup % kLanes == 0, "a group is a whole number of vectors");

// codes and scales of up to two moments: kind 0 signed (int8, -127..127), 1 square (uint8 0..255, of sqrt(v))
struct Quantized {
  void* codes[2];
  uint16_t* scales[2];
  int kind[2];
};

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// quantized._round_bf16: nearest bf16 value, ties to even, in integer arithmetic; NaN stays NaN
inline float round_bf16(float a) {
  if (std::isnan(a)) return a;
  uint32_t u;
  std::memcpy(&u, &a, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&a, &u, 4);
  return a;
}

// the eager step's float -> bf16 copy of the scale (a bf16 value already, or NaN): NaN -> 0xFFFF in ATen's AVX2
// and AVX512 conversion, 0x7FC0 in c10's scalar one (see float_to_bf16_hi)
inline uint16_t float_to_bf16_bits(float f) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (std::isnan(f)) return 0xFFFF;
#else
  if (std::isnan(f)) return 0x7FC0;
#endif
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// quantized.dequantize of one group into out[0..32) (the values past `count` of a short group: code 0, value 0)
inline void dequantize_group(const Quantized& q, int m, int64_t g, int64_t i, int count, float* out) {
  const int kind = q.kind[m];
  const float levels = kind ? 255.0f : 127.0f;
  const float step = bf16_bits_to_float(q.scales[m][g]) / (levels * levels);
#if defined(CPU_CAPABILITY_AVX512)
  if (count == kGroup) {  // the codes widened straight into int32 lanes (sign-extended for int8 codes)
    const uint8_t* codes = static_cast<const uint8_t*>(q.codes[m]) + i;
    for (int j = 0; j < kGroup; j += kLanes) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
      const fvec cv = _mm512_cvtepi32_ps(kind ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
      fvec x = (cv * cv.abs()) * fvec(step);
      if (kind) x = x * x;
      x.store(out + j);
    }
    return;
  }
#endif
  alignas(64) int32_t c[kGroup];
  if (count == kGroup) {  // the byte planes' widening load (packed_io.h), sign-extended for int8 codes
    const uint8_t* codes = static_cast<const uint8_t*>(q.codes[m]) + i;
    for (int j = 0; j < kGroup; j += kLanes) {
      const ivec b = load_u8_at<0>(codes + j);
      (kind ? b : (b << I(24)) >> I(24)).store(c + j);
    }
  } else {
    for (int j = 0; j < kGroup; j++) c[j] = 0;
    for (int j = 0; j < count; j++) {
      c[j] = kind ? static_cast<const uint8_t*>(q.codes[m])[i + j] : static_cast<const int8_t*>(q.codes[m])[i + j];
    }
  }
  for (int j = 0; j < kGroup; j += kLanes) {
    const fvec cv = at::vec::convert_to_fp_of_same_size<float>(ivec::loadu(c + j));
    fvec x = (cv * cv.abs()) * fvec(step);
    if (kind) x = x * x;
    x.store(out + j);
  }
}

// quantized.quantize's scale of one group y[0..32) (a short group's values past its count are zeros, which change
// no maximum): torch.amax of the magnitudes as the largest bit pattern (for floats >= 0 the int32 order is the
// float order, and a NaN, whatever its payload, lies above inf), rounded to bf16
inline float group_scale(const float* y) {
  ivec top(0);
  for (int j = 0; j < kGroup; j += kLanes) top = at::vec::maximum(top, as_int(fvec::loadu(y + j).abs()));
#if defined(CPU_CAPABILITY_AVX512)
  const int32_t top_bits = _mm512_reduce_max_epi32(top);
#else
  alignas(64) int32_t lanes[kLanes];
  top.store(lanes);
  int32_t top_bits = 0;
  for (int j = 0; j < kLanes; j++) top_bits = std::max(top_bits, lanes[j]);
#endif
  float amax;
  std::memcpy(&amax, &top_bits, 4);
  return round_bf16(amax);
}

// quantized.quantize's codes of kLanes values y against the scale (by: safe and its reciprocal), exactly: the
// division by the scale, the correctly rounded square root, round half to even, the clip, NaN to code 0, the sign
template <int kKind>
inline ivec exact_codes(const fvec& yv, const DivideByConstant& by, bool markstein) {
  constexpr float levels = kKind ? 255.0f : 127.0f;
  const fvec t = markstein ? divide<true>(yv.abs(), by) : yv.abs() / by.c;
  fvec cv = sqrt_t(t * fvec(levels * levels)).round();
  cv = fvec::blendv(at::vec::minimum(cv, fvec(levels)), fvec(0.0f), cv != cv);
  if constexpr (!kKind) cv = fvec::blendv(cv, fvec(0.0f) - cv, yv < fvec(0.0f));
  return at::vec::convert_to_int_of_same_size<float>(cv);
}

// NOTE: the codes without the divider where the scale s is a normal number in [2**-60, 2**60] (AVX512 builds): the
// exact code is round(r), r = RN(sqrt(RN(RN(|y| / s) * L**2))); here r' = sqrt(a), a = RN(|y| * RN(L**2 * RN(1 / s))),
// from vrsqrt14ps (relative error <= 2**-14) and one Newton step (error 1.5 * 2**-28 + 1.5 ulp). a and the exact
// radicand differ by at most 5 roundings (2**-24 each, relative; 2.5 after the root), r by one, r' by 1.6: |r' - r|
// <= 5.1 * 2**-24 * 256.5 < 2**-13.5. Where every lane's r' lies more than 2**-12 from a half-integer, r and r'
// round to the same integer (a tie of r is a half-integer: such a lane fails the test), and the codes are
// round(r') clipped, with the sign; otherwise the vector takes exact_codes. A value whose a is below 2**-60 (code
// 0 either way) is raised to it, so 0 reads no 0 * inf. Checked against exact_codes for every fp32 |y| in
// [2**-17 s, 1.004 s] of 48 scales, both kinds (1.4e10 values, none differs; 0.05% of the vectors fell back). On the
// 2-core AMD EPYC (Zen 4), 4M values, 1 thread, loaded: the int8 step 7.35 -> 6.7 ms of thread time (the square
// roots of the codes leave the divider; instructions 16.2 -> 15.7 per value, counted by single-stepping).
#if defined(CPU_CAPABILITY_AVX512)
template <int kKind>
inline bool fast_codes(const fvec& yv, const fvec& k, ivec& out) {
  constexpr float levels = kKind ? 255.0f : 127.0f;
  const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(yv), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 a = _mm512_max_ps(_mm512_mul_ps(mag, k), _mm512_set1_ps(0x1p-60f));
  const __m512 y0 = _mm512_rsqrt14_ps(a);
  const __m512 r = _mm512_mul_ps(a, y0);
  const __m512 e = _mm512_fnmadd_ps(r, _mm512_mul_ps(y0, _mm512_set1_ps(0.5f)), _mm512_set1_ps(0.5f));
  const __m512 root = _mm512_fmadd_ps(r, e, r);
  const __m512 c = _mm512_roundscale_ps(root, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 off = _mm512_abs_ps(_mm512_sub_ps(root, c));
  if (_mm512_cmp_ps_mask(off, _mm512_set1_ps(0.5f - 0x1p-12f), _CMP_GE_OQ) != 0) return false;
  __m512 cv = _mm512_min_ps(c, _mm512_set1_ps(levels));
  if constexpr (!kKind) {  // the sign of y (a -0.0 code converts to 0)
    cv = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(cv),
                                             _mm512_and_si512(_mm512_castps_si512(yv), _mm512_set1_epi32(INT32_MIN))));
  }
  out = _mm512_cvttps_epi32(cv);
  return true;
}
#endif

// quantized.quantize's codes of one group y[0..count) against its scale s (for a second moment y is sqrt(v))
template <int kKind>
inline void group_codes_of(const Quantized& q, int m, int64_t g, int64_t i, int count, const float* y, float s) {
  constexpr float levels = kKind ? 255.0f : 127.0f;
  const float safe = s > 0.0f ? s : 1.0f;  // where(s > 0, s, 1): a zero or NaN scale divides by 1
  // NOTE: |y| / s correctly rounded without the divider (packed_vec.h's divide, Markstein) where s lies in
  // [2**-60, 2**60]: then |y| <= 1.004 s keeps 1/s, the quotient and its remainder normal, except for quotients
  // below 2**-42, whose code is 0 either way; elsewhere (and in WB_DIVIDE_PLAIN builds) the plain division.
  const bool markstein = !WB_DIVIDE_PLAIN && safe >= 0x1p-60f && safe <= 0x1p60f;
  const bool in_range = s >= 0x1p-60f && s <= 0x1p60f;  // the fast codes' range (not a zero or NaN scale)
  const float inverse = 1.0f / safe;
  const DivideByConstant by{fvec(safe), fvec(inverse)};
  alignas(64) int32_t c[kGroup];
  uint8_t* const bytes = static_cast<uint8_t*>(q.codes[m]) + i;  // int8 codes: their two's complement byte
#if defined(CPU_CAPABILITY_AVX512)
  const fvec k(levels * levels * inverse);
#endif
  for (int j = 0; j < kGroup; j += kLanes) {
    const fvec yv = fvec::loadu(y + j);
    ivec ci;
#if defined(CPU_CAPABILITY_AVX512)
    if (!in_range || !fast_codes<kKind>(yv, k, ci)) ci = exact_codes<kKind>(yv, by, markstein);
#else
    ci = exact_codes<kKind>(yv, by, markstein);
#endif
    if (count == kGroup) store_u8_from<0>(bytes + j, ci);  // the byte planes' narrowing store
    else ci.store(c + j);
  }
  for (int j = 0; count < kGroup && j < count; j++) bytes[j] = static_cast<uint8_t>(c[j]);
  q.scales[m][g] = float_to_bf16_bits(s);
}

inline void group_codes(const Quantized& q, int m, int64_t g, int64_t i, int count, const float* y, float s) {
  q.kind[m] ? group_codes_of<1>(q, m, g, i, count, y, s) : group_codes_of<0>(q, m, g, i, count, y, s);
}

// One group's merge, fp32 update and split by the fp32-state kernel K's block, on st0/st1 (its dequantized
// moments, or nullptr) and the root of its new second moment into `roots`.
template <class K, bool kExact, class S>
void step_group(const S& s, int64_t i, int count, float* st0, float* st1, float* roots, const fvec* c,
                const DivideByConstant& c5) {
  char* s0 = reinterpret_cast<char*>(st0);
  char* s1 = reinterpret_cast<char*>(st1);
  if (count == kGroup) {
    for (int b = 0; b < kGroup; b += kLanes) {
      K::template block<kExact, true>(s.half + i + b, s.grad + i + b, s.plane0 ? s.plane0 + i + b : nullptr,
                                      s.plane1 ? s.plane1 + i + b : nullptr, s0 ? s0 + b * 4 : nullptr,
                                      s1 ? s1 + b * 4 : nullptr, c, c5,
                                      hash_seed(static_cast<int32_t>(s.offset + i + b), s.key), s.momentum,
                                      s.nesterov, s.first, roots + b);
    }
    return;
  }
  // the short last group: zero-padded copies, as the fp32 kernel's tail
  alignas(64) uint16_t th[kGroup] = {}, tg[kGroup] = {};
  alignas(64) uint8_t t0[kGroup] = {}, t1[kGroup] = {};
  std::memcpy(th, s.half + i, count * 2);
  std::memcpy(tg, s.grad + i, count * 2);
  if (s.plane0) std::memcpy(t0, s.plane0 + i, count);
  if (s.plane1) std::memcpy(t1, s.plane1 + i, count);
  for (int b = 0; b < kGroup; b += kLanes) {
    K::template block<kExact, true>(th + b, tg + b, t0 + b, t1 + b, s0 ? s0 + b * 4 : nullptr,
                                    s1 ? s1 + b * 4 : nullptr, c, c5,
                                    hash_seed(static_cast<int32_t>(s.offset + i + b), s.key), s.momentum, s.nesterov,
                                    s.first, roots + b);
  }
  std::memcpy(s.half + i, th, count * 2);
  if (s.plane0) std::memcpy(s.plane0 + i, t0, count);
  if (s.plane1) std::memcpy(s.plane1 + i, t1, count);
}

// The step over n values in groups of 32 (`s.state0/1` unused): K is the fp32-state kernel of the format; `nq`
// moments (0, 1 or 2) are quantized; the group of value i is i / 32 (a segment starts on a group bound).
// NOTE: kBatch groups at a time, each phase over all of them, so the CPU can overlap the groups' serial chains
// (maximum, scale, division, square root). Measured on the 2-core AMD EPYC (Zen 4), 4M values, 1 thread, the
// kernel alone: 21 ms with ATen's vec_reduce_all for the maximum, 9.5 ms with the integer maximum, 8.0 ms taking
// sqrt(v) from the step's block and dividing by the scale without the divider, 7.7 ms in batches of 4; the fp32
// kernel 1.9-2.2 ms, torch's fused AdamW 2.3-2.5 ms. Since (fast_codes, no square root for the codes; codes widened
// straight into lanes): ~500 instructions per group of 32 against the fp32 kernel's ~100 (the group loop's scalar
// bookkeeping, the scale's reduction and bf16 rounding, the codes' tie test), so instructions bound it now.
constexpr int kBatch = 4;

template <class K, bool kExact, class S>
void quantized_range(const S& s, const Quantized& q, int nq, int64_t n, int64_t g0, int64_t g1,
                     const fvec* c, const DivideByConstant& c5) {
  alignas(64) float st[2][kBatch * kGroup];
  alignas(64) float roots[kBatch * kGroup];  // sqrt of the new second moments, from the step's block
  for (int64_t g = g0; g < g1; g += kBatch) {
    const int nb = static_cast<int>(std::min<int64_t>(kBatch, g1 - g));
    int counts[kBatch];
    for (int k = 0; k < nb; k++) {
      const int64_t i = (g + k) * kGroup;
      counts[k] = static_cast<int>(std::min<int64_t>(kGroup, n - i));
      for (int m = 0; m < nq; m++) dequantize_group(q, m, g + k, i, counts[k], st[m] + k * kGroup);
    }
    for (int k = 0; k < nb; k++) {
      step_group<K, kExact>(s, (g + k) * kGroup, counts[k], nq > 0 ? st[0] + k * kGroup : nullptr,
                            nq > 1 ? st[1] + k * kGroup : nullptr, roots + k * kGroup, c, c5);
    }
    for (int m = 0; m < nq; m++) {
      const float* y = q.kind[m] ? roots : st[m];
      float scale[kBatch];
      for (int k = 0; k < nb; k++) scale[k] = group_scale(y + k * kGroup);
      for (int k = 0; k < nb; k++) group_codes(q, m, g + k, (g + k) * kGroup, counts[k], y + k * kGroup, scale[k]);
    }
  }
}

}  // namespace workbench_packed
