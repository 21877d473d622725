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
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "packed_vec.h"

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
  alignas(64) int32_t c[kGroup];
  if (count == kGroup) {  // constant trip counts: vectorised widening
    if (kind) {
      const uint8_t* codes = static_cast<const uint8_t*>(q.codes[m]) + i;
      for (int j = 0; j < kGroup; j++) c[j] = codes[j];
    } else {
      const int8_t* codes = static_cast<const int8_t*>(q.codes[m]) + i;
      for (int j = 0; j < kGroup; j++) c[j] = codes[j];
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

// quantized.quantize of values[0..count) (one group; a short group's values past `count` are zeros, which change
// no maximum) into its codes and scale
inline void quantize_group(const Quantized& q, int m, int64_t g, int64_t i, int count, const float* values) {
  const int kind = q.kind[m];
  const float levels = kind ? 255.0f : 127.0f;
  fvec y[kGroup / kLanes];
  fvec top(0.0f);
  for (int j = 0; j < kGroup / kLanes; j++) {
    const fvec v = fvec::loadu(values + j * kLanes);
    y[j] = kind ? sqrt_t(v) : v;
    top = at::vec::maximum(top, y[j].abs());  // torch.amax: NaN wins (lane by lane, then across lanes)
  }
  const float amax = at::vec::vec_reduce_all<float>(
      [](const fvec& a, const fvec& b) { return at::vec::maximum(a, b); }, top);
  const float s = round_bf16(amax);
  const fvec safe(s > 0.0f ? s : 1.0f);  // where(s > 0, s, 1): a zero or NaN scale divides by 1
  alignas(64) int32_t c[kGroup];
  for (int j = 0; j < kGroup / kLanes; j++) {
    const fvec t = y[j].abs() / safe;
    fvec cv = sqrt_t(t * fvec(levels * levels)).round();
    cv = fvec::blendv(at::vec::minimum(cv, fvec(levels)), fvec(0.0f), cv != cv);
    if (!kind) cv = fvec::blendv(cv, fvec(0.0f) - cv, y[j] < fvec(0.0f));
    at::vec::convert_to_int_of_same_size<float>(cv).store(c + j * kLanes);
  }
  if (kind) {
    uint8_t* codes = static_cast<uint8_t*>(q.codes[m]) + i;
    if (count == kGroup) {
      for (int j = 0; j < kGroup; j++) codes[j] = static_cast<uint8_t>(c[j]);
    } else {
      for (int j = 0; j < count; j++) codes[j] = static_cast<uint8_t>(c[j]);
    }
  } else {
    int8_t* codes = static_cast<int8_t*>(q.codes[m]) + i;
    if (count == kGroup) {
      for (int j = 0; j < kGroup; j++) codes[j] = static_cast<int8_t>(c[j]);
    } else {
      for (int j = 0; j < count; j++) codes[j] = static_cast<int8_t>(c[j]);
    }
  }
  q.scales[m][g] = float_to_bf16_bits(s);
}

// The step over n values in groups of 32 (`s.state0/1` unused): K is the fp32-state kernel of the format.
// `nq` moments (0, 1 or 2) are quantized; the group of value i is i / 32 (a segment starts on a group bound).
template <class K, bool kExact, class S>
void quantized_range(const S& s, const Quantized& q, int nq, int64_t n, int64_t g0, int64_t g1,
                     const fvec* c, const DivideByConstant& c5) {
  alignas(64) float st[2][kGroup];
  for (int64_t g = g0; g < g1; g++) {
    const int64_t i = g * kGroup;
    const int count = static_cast<int>(std::min<int64_t>(kGroup, n - i));
    for (int m = 0; m < nq; m++) dequantize_group(q, m, g, i, count, st[m]);
    char* s0 = nq > 0 ? reinterpret_cast<char*>(st[0]) : nullptr;
    char* s1 = nq > 1 ? reinterpret_cast<char*>(st[1]) : nullptr;
    if (count == kGroup) {
      for (int b = 0; b < kGroup; b += kLanes) {
        K::template block<kExact>(s.half + i + b, s.grad + i + b, s.plane0 ? s.plane0 + i + b : nullptr,
                                  s.plane1 ? s.plane1 + i + b : nullptr, s0 ? s0 + b * 4 : nullptr,
                                  s1 ? s1 + b * 4 : nullptr, c, c5,
                                  hash_seed(static_cast<int32_t>(s.offset + i + b), s.key), s.momentum, s.nesterov,
                                  s.first);
      }
    } else {  // the short last group: zero-padded copies, as the fp32 kernel's tail
      alignas(64) uint16_t th[kGroup] = {}, tg[kGroup] = {};
      alignas(64) uint8_t t0[kGroup] = {}, t1[kGroup] = {};
      std::memcpy(th, s.half + i, count * 2);
      std::memcpy(tg, s.grad + i, count * 2);
      if (s.plane0) std::memcpy(t0, s.plane0 + i, count);
      if (s.plane1) std::memcpy(t1, s.plane1 + i, count);
      for (int b = 0; b < kGroup; b += kLanes) {
        K::template block<kExact>(th + b, tg + b, t0 + b, t1 + b, s0 ? s0 + b * 4 : nullptr, s1 ? s1 + b * 4 : nullptr,
                                  c, c5, hash_seed(static_cast<int32_t>(s.offset + i + b), s.key), s.momentum,
                                  s.nesterov, s.first);
      }
      std::memcpy(s.half + i, th, count * 2);
      if (s.plane0) std::memcpy(s.plane0 + i, t0, count);
      if (s.plane1) std::memcpy(s.plane1 + i, t1, count);
    }
    for (int m = 0; m < nq; m++) quantize_group(q, m, g, i, count, st[m]);
  }
}

}  // namespace workbench_packed
