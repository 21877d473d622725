// Standalone check of the division by a per-step constant in packed_vec.h (not part of the kernel):
// for each divisor c, every significand of x in [1, 2) (and the same values scaled by 2**-70, as
// sqrt of a small second moment), RN(q + r * y) with y = RN(1/c), q = RN(x * y), r = fma(-q, c, x)
// must equal vdivps's RN(x / c). Divisors: Adam's sqrt(1 - beta2**t) for beta2 = 0.999 and 0.99,
// t = 1..2000, then random significands in [0.5, 1). The exponent of c only scales y exactly.
//
//   g++ -O2 -mavx512f -mavx512dq -o markstein_check markstein_check.cpp && ./markstein_check 10000
//
// Measured on the development machine (Xeon, AVX512): 0 mismatches over 10000 divisors x 2**24 values.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

int main(int argc, char** argv) {
  const int divisors = argc > 1 ? std::atoi(argv[1]) : 1000;
  std::mt19937 gen(1);
  long long mismatches = 0, checked = 0;
  for (int i = 0; i < divisors; i++) {
    float c;
    if (i < 2000) {
      c = static_cast<float>(std::sqrt(1.0 - std::pow(0.999, i + 1)));
    } else if (i < 4000) {
      c = static_cast<float>(std::sqrt(1.0 - std::pow(0.99, i - 1999)));
    } else {
      const uint32_t bits = (gen() & 0x7FFFFFu) | (126u << 23);
      std::memcpy(&c, &bits, 4);
    }
    const __m512 vc = _mm512_set1_ps(c), vy = _mm512_set1_ps(1.0f / c);
    const __m512 lane = _mm512_castsi512_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    for (uint32_t s = 0; s < (1u << 23); s += 16) {
      const __m512i xi = _mm512_or_si512(_mm512_set1_epi32(static_cast<int>((127u << 23) | s)),
                                         _mm512_castps_si512(lane));
      for (int scaled = 0; scaled < 2; scaled++) {
        __m512 x = _mm512_castsi512_ps(xi);
        if (scaled) x = _mm512_mul_ps(x, _mm512_set1_ps(0x1p-70f));
        const __m512 q = _mm512_mul_ps(x, vy);
        const __m512 r = _mm512_fnmadd_ps(q, vc, x);
        const __m512 fine = _mm512_fmadd_ps(r, vy, q);
        mismatches += __builtin_popcount(_mm512_cmp_ps_mask(fine, _mm512_div_ps(x, vc), _CMP_NEQ_UQ));
        checked += 16;
      }
    }
  }
  std::printf("%lld mismatches over %d divisors x %lld values\n", mismatches, divisors, checked / divisors);
  return mismatches != 0;
}
