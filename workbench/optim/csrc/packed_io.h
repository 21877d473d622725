// Loads and stores of the packed CPU step (packed_step.cpp): 16-bit values, byte planes and bf16 master
// values moved between memory and fp32/int32 vector lanes, kLanes at a time. Included by packed_vec.h;
// see packed_step.cpp for the paper and why.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace workbench_packed {

using fvec = at::vec::Vectorized<float>;
using ivec = at::vec::Vectorized<int32_t>;
constexpr int kLanes = fvec::size();
static_assert(ivec::size() == kLanes, "int32 and float vectors must have the same lane count");

// ------------------------------------------------------------------ narrow loads and stores
// Each reads or writes exactly kLanes elements; the tail goes through a padded buffer.

// The generic build's: lane by lane through an aligned int32 buffer.
template <typename T>
inline ivec widen_lanes(const T* p) {
  alignas(64) int32_t b[kLanes];
  for (int j = 0; j < kLanes; j++) b[j] = p[j];
  return ivec::loadu(b);
}

template <typename T>
inline void narrow_lanes(T* p, const ivec& v) {
  alignas(64) int32_t b[kLanes];
  v.store(b);
  for (int j = 0; j < kLanes; j++) p[j] = static_cast<T>(b[j]);
}

inline ivec load_u16(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return widen_lanes(p);
#endif
}

inline ivec load_u8(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return widen_lanes(p);
#endif
}

// low 16 bits of each lane (a truncating store, as torch's int32 -> int16 conversion)
inline void store_u16(uint16_t* p, const ivec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i w = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(w));
#else
  narrow_lanes(p, v);
#endif
}

// low 8 bits of each lane
inline void store_u8(uint8_t* p, const ivec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i w = _mm256_and_si256(v, _mm256_set1_epi32(0xFF));
  w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0xD8);
  w = _mm256_packus_epi16(w, w);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(w));
#else
  narrow_lanes(p, v);
#endif
}

// fp16 -> fp32 as ATen's vectorised conversion does it (F16C; the same for every non-NaN value)
inline fvec load_fp16_as_float(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(64) float b[kLanes];
  for (int j = 0; j < kLanes; j++) b[j] = static_cast<float>(c10::Half(p[j], c10::Half::from_bits()));
  return fvec::loadu(b);
#endif
}

// NOTE: the bf16 step keeps a 16-bit pattern in the upper half of its lane (where fp32 keeps it) and
// a byte plane at its byte position, so loads and stores are one permute each on AVX512 instead of
// a widening move plus a shift (512-bit shifts only issue on one port, and the step is port-bound).
// Lanes holding pattern << 16 (the bf16 value as fp32 bits), from kLanes 16-bit patterns.
inline ivec load_u16_hi(const uint16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i odd_from = _mm512_set_epi32(15 << 16, 14 << 16, 13 << 16, 12 << 16, 11 << 16, 10 << 16, 9 << 16,
                                            8 << 16, 7 << 16, 6 << 16, 5 << 16, 4 << 16, 3 << 16, 2 << 16, 1 << 16, 0);
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_maskz_permutexvar_epi16(0xAAAAAAAA, odd_from, _mm512_castsi256_si512(words));
#else
  return load_u16(p) << ivec(16);
#endif
}

// store the upper 16 bits of each lane
inline void store_u16_hi(uint16_t* p, const ivec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i odd_words = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, (31 << 16) | 29, (27 << 16) | 25,
                                             (23 << 16) | 21, (19 << 16) | 17, (15 << 16) | 13, (11 << 16) | 9,
                                             (7 << 16) | 5, (3 << 16) | 1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd_words, v)));
#else
  store_u16(p, v >> ivec(16));
#endif
}

// Lanes holding byte << (8 * J), from kLanes bytes.
template <int J>
inline ivec load_u8_at(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  // each 128-bit lane L holds all 16 bytes; its dword t takes byte 4L + t into byte position J
  alignas(64) static const int8_t ctrl[64] = {
#define WB_B(L, t) (J == 0 ? 4 * L + t : -128), (J == 1 ? 4 * L + t : -128), (J == 2 ? 4 * L + t : -128), \
                   (J == 3 ? 4 * L + t : -128)
#define WB_LANE(L) WB_B(L, 0), WB_B(L, 1), WB_B(L, 2), WB_B(L, 3)
      WB_LANE(0), WB_LANE(1), WB_LANE(2), WB_LANE(3)};
#undef WB_LANE
#undef WB_B
  const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_shuffle_epi8(all, _mm512_load_si512(ctrl));
#else
  return load_u8(p) << ivec(8 * J);
#endif
}

// store byte J of each lane
template <int J>
inline void store_u8_from(uint8_t* p, const ivec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (J == 0) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  } else {
    // gather byte J of the lane's 4 dwords into its first dword, then the 4 first dwords together
    alignas(64) static const int8_t ctrl[64] = {
#define WB_LANE J, 4 + J, 8 + J, 12 + J, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128
        WB_LANE, WB_LANE, WB_LANE, WB_LANE};
#undef WB_LANE
    const __m512i packed = _mm512_shuffle_epi8(v, _mm512_load_si512(ctrl));
    const __m512i firsts = _mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0),
                                                    packed);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_castsi512_si128(firsts));
  }
#else
  store_u8(p, v >> ivec(8 * J));
#endif
}

// The fp32 bits of kLanes bf16 master values whose extra bits are 0, 1 or 2 whole byte planes right below
// the 16-bit pattern (lane i: half[i] << 16 | plane0[i] << 8, or half[i] << 16 | plane1[i] << 8 | plane0[i]),
// and their split back. NOTE: with AVX512-VBMI (cpu_kernel.py adds -mavx512vbmi where the CPU has it) one
// two-source byte permute assembles a vector, and one byte permute takes it apart (the planes then sit in
// its third and fourth 128-bit lanes, one extract each): 1 instead of 3 vector ops to load bf16+8 and 2
// instead of 3 to store; 2 instead of 5 to load bf16+16 and 3 instead of 4 to store. Without VBMI: a word
// permute and a byte shuffle per plane.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VBMI__)
template <int kPlanes>
struct MasterBytes {
  alignas(64) int8_t gather[64];   // vpermt2b: byte < 64 from the half's 32 bytes, 64 + j byte j of the planes
  alignas(64) int8_t scatter[64];  // vpermb: half words, then plane0's bytes, then plane1's
  constexpr MasterBytes() : gather(), scatter() {
    for (int i = 0; i < 16; i++) {
      gather[4 * i] = kPlanes == 2 ? 64 + i : 0;
      gather[4 * i + 1] = kPlanes == 2 ? 80 + i : 64 + i;
      gather[4 * i + 2] = static_cast<int8_t>(2 * i);
      gather[4 * i + 3] = static_cast<int8_t>(2 * i + 1);
      scatter[2 * i] = static_cast<int8_t>(4 * i + 2);
      scatter[2 * i + 1] = static_cast<int8_t>(4 * i + 3);
      scatter[32 + i] = static_cast<int8_t>(kPlanes == 2 ? 4 * i : 4 * i + 1);
      scatter[48 + i] = static_cast<int8_t>(4 * i + 1);
    }
  }
};
template <int kPlanes>
inline constexpr MasterBytes<kPlanes> kMasterBytes{};
#endif

template <int kPlanes>
inline ivec load_bf16_master(const uint16_t* half, const uint8_t* plane0, const uint8_t* plane1) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VBMI__)
  if constexpr (kPlanes > 0) {
    const __m512i h = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)));
    __m512i p = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane0)));
    if constexpr (kPlanes == 2) p = _mm512_inserti32x4(p, _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane1)), 1);
    constexpr __mmask64 kept = kPlanes == 2 ? ~0ULL : 0xEEEEEEEEEEEEEEEEULL;  // byte 0 of a lane: zero with one plane
    return _mm512_maskz_permutex2var_epi8(kept, h, _mm512_load_si512(kMasterBytes<kPlanes>.gather), p);
  }
#endif
  ivec low = ivec(0);
  if constexpr (kPlanes == 1) low = load_u8_at<1>(plane0);
  if constexpr (kPlanes == 2) low = load_u8_at<0>(plane0) | load_u8_at<1>(plane1);
  return load_u16_hi(half) | low;
}

template <int kPlanes>
inline void store_bf16_master(uint16_t* half, uint8_t* plane0, uint8_t* plane1, const ivec& bits) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VBMI__)
  if constexpr (kPlanes > 0) {
    const __m512i parts = _mm512_permutexvar_epi8(_mm512_load_si512(kMasterBytes<kPlanes>.scatter), bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(half), _mm512_castsi512_si256(parts));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(plane0), _mm512_extracti32x4_epi32(parts, 2));
    if constexpr (kPlanes == 2) _mm_storeu_si128(reinterpret_cast<__m128i*>(plane1), _mm512_extracti32x4_epi32(parts, 3));
    return;
  }
#endif
  store_u16_hi(half, bits);
  if constexpr (kPlanes == 1) {
    store_u8_from<1>(plane0, bits);
  } else if constexpr (kPlanes == 2) {
    store_u8_from<0>(plane0, bits);
    store_u8_from<1>(plane1, bits);
  }
}

}  // namespace workbench_packed
