// The packed CPU step's kernel templates (the format, master rounding, state dtype and algorithm as template
// parameters), shared by the two translation units that instantiate them: packed_step.cpp (the op and the fp16 formats)
// and packed_bf16.cpp (the bf16 formats).
//
// NOTE: two translation units so that ninja compiles them side by side (one per core): the instantiations are most
// of the build, which took 44 s in one unit on the 2-core AMD EPYC (Zen 4), 22.7 and 24.2 s in these two.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "packed_int8.h"
#include "packed_vec.h"

namespace workbench_packed {

// ------------------------------------------------------------------------------- the step
// NOTE: the build's variant (workbench/optim/cpu_variants.py) sets these defines; every variant gives the same
// bits, only its speed differs by CPU. Each stream is prefetched WB_PREFETCH_BLOCKS blocks ahead (0: no software
// prefetch; 32 blocks are 2 KB of fp32 moments) with the hint WB_PREFETCH_HINT (0: prefetchnta, 1: prefetcht0,
// 2: prefetchw, which needs -mprfchw); WB_DIVIDE_PLAIN 1 divides by sqrt(1 - beta2**t) with the divider instead
// of packed_vec.h's multiply-and-correct (which takes FMA and, on AVX512, fpclass uops: port 5 on Intel). On the
// 2-core EPYC (Zen 4), 4M values in 8 segments, 1 thread, load 3.9, kernel alone against the same kernel without
// software prefetch: 16 blocks ahead 1.03x (bf16+8) and 1.15x (bf16+16), 32 blocks 1.045x and 1.13x.
#ifndef WB_PREFETCH_BLOCKS
#define WB_PREFETCH_BLOCKS 32
#endif
#ifndef WB_PREFETCH_HINT
#define WB_PREFETCH_HINT 0
#endif
#ifndef WB_DIVIDE_PLAIN
#define WB_DIVIDE_PLAIN 0
#endif
constexpr int64_t kPrefetchBlocks = WB_PREFETCH_BLOCKS;
static_assert(kPrefetchBlocks >= 0, "WB_PREFETCH_BLOCKS: 0 (off) or a positive block count");

// a hint to bring the line `Bytes` past p into the cache (no fault whatever the address: computed as an integer)
template <int64_t Bytes>
inline void prefetch_ahead(const void* p) {
  if constexpr (Bytes > 0) {
    const void* at = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + Bytes);
#if WB_PREFETCH_HINT == 2
    __builtin_prefetch(at, 1, 3);  // prefetchw: the line fetched for writing
#elif WB_PREFETCH_HINT == 1
    __builtin_prefetch(at, 0, 3);  // prefetcht0
#else
    __builtin_prefetch(at, 0, 0);  // prefetchnta
#endif
  }
}

enum Math : int64_t { kAdamW = 0, kAdam = 1, kSgd = 2 };

struct Step {
  uint16_t* half;
  const uint16_t* grad;
  uint8_t* plane0;
  uint8_t* plane1;
  void* state0;
  void* state1;
  float c[9];
  int32_t key;
  int64_t offset;
  bool momentum, nesterov, first;  // SGD's options (runtime: SGD is not the measured case)
};

// NOTE: the format (dtype, planes, stochastic rounding; they fix the extra bits), the master
// rounding (kMaster: 0 truncate, 1 stochastic, 2 nearest), the state dtype and the algorithm are
// template parameters: the loop has no branch and every shift is by a constant. Pointers and options
// are copied into locals before the loop, since a uint8 store may alias anything reachable through a
// pointer and would force reloads.
template <bool kFp16, int kPlanes, bool kSR, int kMaster, bool kBf16State, int kMath>
struct Kernel {
  static constexpr int kFull = kFp16 ? 13 : 16;
  static constexpr int kExtra = 8 * kPlanes - (kSR ? 1 : 0);  // the extra bits k
  static constexpr int kDrop = kFull - kExtra;
  static constexpr bool kNoise = kMaster == 1 && kExtra < kFull;
  // nearest (split_merge's module docstring): the master rounded to nearest at its lowest kept bit (the
  // noise step with the constant half of that bit), the 16-bit value rounded to nearest over the extra bits
  static constexpr bool kNearest = kMaster == 2;
  static constexpr bool kRoundMaster = kNoise || (kNearest && kExtra < kFull);
  static_assert(!(kNearest && kSR), "nearest master rounding excludes stochastic rounding");
  static constexpr int32_t kInf = kFp16 ? 0x7C00 : 0x7F80;
  static constexpr int64_t kStateSize = kBf16State ? 2 : 4;
  static constexpr bool kFast = !kFp16 && !kSR;  // byte-aligned extra bits right below the pattern

  static fvec load_state(const char* p) {
    if constexpr (kBf16State) return as_float(load_u16_hi(reinterpret_cast<const uint16_t*>(p)));
    else return fvec::loadu(p);
  }
  static void store_state(char* p, const fvec& v) {
    if constexpr (kBf16State) store_bf16(reinterpret_cast<uint16_t*>(p), v);
    else v.store(p);
  }

  // kLanes values: merge, the fp32 update, split (split_merge.merge_values / update.*_math /
  // split_merge.split_values); `seed` is hash_seed of the values' indices in the random stream.
  // kRoot: also store sqrt(v) (Adam's new second moment's root) at `root`, for 8-bit moments (packed_int8.h)
  template <bool kExact, bool kRoot = false>
  static inline void block(uint16_t* half, const uint16_t* grad, uint8_t* plane0, uint8_t* plane1, char* state0,
                           char* state1, const fvec* c, const DivideByConstant& c5, const ivec& seed,
                           bool momentum, bool nesterov, bool first, float* root = nullptr) {
    fvec master;
    if constexpr (kFast) {  // bf16 without the rounding flag: the pattern and the extra bits (none: k = 0)
      ivec bits = load_bf16_master<kPlanes>(half, plane0, plane1);
      if constexpr (kNearest && kExtra > 0) {  // undo the round-up: top extra bit (bit 15) set, the half not NaN
        const ivec not_nan = sign_mask((bits & I(0x7FFFFFFF)) - I(0x7F810000));
        bits = bits - (((bits & I(0x8000)) << I(1)) & not_nan);
      }
      master = as_float(bits);
    } else {
      ivec hb = load_u16(half);
      ivec values = I(0);
      if constexpr (kPlanes >= 1) values = load_u8_at<0>(plane0);
      if constexpr (kPlanes == 2) values = values | load_u8_at<1>(plane1);
      if constexpr (kSR) {
        hb = hb - (values & I(1));  // un-round
        values = values >> I(1);
      }
      if constexpr (kNearest && kExtra > 0) {  // undo the round-up where the top extra bit is set, not NaN
        hb = hb - ((values >> I(kExtra - 1)) & I(1) & sign_mask((hb & I(0x7FFF)) - I(kInf + 1)));
      }
      master = compose<kFp16>(hb, values << I(kDrop));
    }
    fvec g = kFp16 ? load_fp16_as_float(grad) : as_float(load_u16_hi(grad));
    if constexpr (kMath == kSgd) {
      g = add_t(g, c[1] * master);
      if (momentum) {
        fvec buf = first ? g : add_t(load_state(state0) * c[2], c[3] * g);
        store_state(state0, buf);
        g = nesterov ? add_t(g, c[2] * buf) : buf;
      }
      master = sub_t(master, c[0] * g);
    } else {
      if constexpr (kMath == kAdamW) master = master * c[0];
      else g = add_t(g, c[1] * master);
      const fvec m = add_t(load_state(state0) * c[8], g * c[2]);
      store_state(state0, m);
      const fvec v = add_t(load_state(state1) * c[3], g * g * c[4]);
      store_state(state1, v);
      const fvec rv = sqrt_t(v);
      if constexpr (kRoot) rv.store(root);
      const fvec denom = divide<kExact>(rv, c5) + c[6];  // eps is never NaN
      master = sub_t(master, c[7] * (m / denom));
    }
    if constexpr (kFast) {  // split: the upper half is the pattern, the lower the extra bits
      ivec bits = as_int(master);
      // master rounding: the noise below the lowest kept bit added to the sign-magnitude pattern
      // (split_merge's z + r on |x|, the sign untouched since a finite |x| + r stays below inf)
      if constexpr (kNoise) bits = add_below_inf(bits, hash_mix(seed) & I((1 << kDrop) - 1));
      if constexpr (kNearest && kExtra < kFull) bits = add_below_inf(bits, I(1 << (kDrop - 1)));
      // master is an arithmetic result (sub_t): already quiet where x86 arithmetic quiets
      if constexpr ((kExtra < kFull || kNearest) && !kArithmeticQuiets) bits = quiet_if_nan(bits, master);
      if constexpr (kNearest && kExtra > 0) {  // round up: top extra bit (bit 15) set and the half finite
        // (k = 0: the master rounding above already rounded the half to nearest; its dropped bits are stale)
        const ivec finite = sign_mask((bits & I(0x7FFFFFFF)) - I(0x7F800000));
        bits = bits + (((bits & I(0x8000)) << I(1)) & finite);
      }
      store_bf16_master<kPlanes>(half, plane0, plane1, bits);
      return;
    }
    ivec hb, low;
    fields<kFp16>(master, hb, low);
    ivec nan_bit = I(0);
    if constexpr (!kFp16 && (kExtra < kFull || kNearest)) {  // keep a NaN a NaN once its low bits are dropped
      nan_bit = sign_mask(I(0x7F800000) - (((hb & I(0x7FFF)) << I(16)) | low)) & I(0x40);
    }
    ivec h = I(0);
    if constexpr (kSR || kNoise) h = hash_mix(seed);
    if constexpr (kRoundMaster) {  // stochastic (or, nearest: half-up) rounding at the lowest kept bit
      const ivec sign = hb & I(0x8000), mag = hb & I(0x7FFF);
      ivec z = (mag << I(kFull)) | low;
      const ivec r = kNoise ? h & I((1 << kDrop) - 1) : I(1 << (kDrop - 1));
      const ivec ok = sign_mask((mag - I(kInf)) & (((z + r) >> I(kFull)) - I(kInf)));
      z = z + (r & ok);
      hb = sign | (z >> I(kFull));
      low = ((z & I((1 << kFull) - 1)) >> I(kDrop)) << I(kDrop);
    }
    ivec values = low >> I(kDrop);
    hb = hb | nan_bit;
    if constexpr (kNearest) {  // round the 16-bit value up: first dropped bit set and the pattern finite
      hb = hb + ((low >> I(kFull - 1)) & I(1) & sign_mask((hb & I(0x7FFF)) - I(kInf)));
    }
    if constexpr (kSR) {  // round the 16-bit value up when the remainder exceeds the noise
      const ivec noise = (h >> I(16)) & I((1 << kFull) - 1);
      const ivec up = sign_mask((noise - low) & ((hb & I(0x7FFF)) + I(1 - kInf))) & I(1);
      hb = hb + up;
      values = (values << I(1)) | up;
    }
    store_u16(half, hb);
    if constexpr (kPlanes >= 1) store_u8_from<0>(plane0, values);
    if constexpr (kPlanes == 2) store_u8_from<1>(plane1, values);
  }

  // blocks b0 .. b1 - 1 of kLanes values (the last one may be a tail shorter than kLanes)
  template <bool kExact>
  static void range(const Step& s, int64_t n, int64_t b0, int64_t b1, const fvec* c, const DivideByConstant& c5) {
    // NOTE: pointers and options in locals, each pointer stepped by a constant (no per-block test for an
    // absent plane or state), since a uint8 store may alias anything reachable through a pointer.
    const int64_t first_i = b0 * kLanes;
    uint16_t* half = s.half + first_i;
    const uint16_t* grad = s.grad + first_i;
    uint8_t* p0 = kPlanes >= 1 ? s.plane0 + first_i : nullptr;
    uint8_t* p1 = kPlanes == 2 ? s.plane1 + first_i : nullptr;
    char* const s0_base = static_cast<char*>(s.state0);
    char* const s1_base = static_cast<char*>(s.state1);
    char* s0 = s0_base ? s0_base + first_i * kStateSize : nullptr;
    char* s1 = s1_base ? s1_base + first_i * kStateSize : nullptr;
    const int64_t s0_step = s0 ? kLanes * kStateSize : 0, s1_step = s1 ? kLanes * kStateSize : 0;
    const bool momentum = s.momentum, nesterov = s.nesterov, first = s.first;
    fvec cl[9];
    for (int j = 0; j < 9; j++) cl[j] = c[j];
    const DivideByConstant c5l = c5;
    const int64_t full_end = std::min(b1, n / kLanes);
    // the hash's first multiply, index * golden ratio, stepped by an add (int32 arithmetic wraps alike)
    ivec seed = hash_seed(static_cast<int32_t>(s.offset + first_i), s.key);
    const ivec seed_step = I(static_cast<int32_t>(kLanes * kGolden));
    for (int64_t blk = b0; blk < full_end; blk++, seed = seed + seed_step) {
      prefetch_ahead<kPrefetchBlocks * kLanes * 2>(half);
      prefetch_ahead<kPrefetchBlocks * kLanes * 2>(grad);
      if constexpr (kPlanes >= 1) prefetch_ahead<kPrefetchBlocks * kLanes>(p0);
      if constexpr (kPlanes == 2) prefetch_ahead<kPrefetchBlocks * kLanes>(p1);
      if (s0) prefetch_ahead<kPrefetchBlocks * kLanes * kStateSize>(s0);
      if (s1) prefetch_ahead<kPrefetchBlocks * kLanes * kStateSize>(s1);
      block<kExact>(half, grad, p0, p1, s0, s1, cl, c5l, seed, momentum, nesterov, first);
      half += kLanes;
      grad += kLanes;
      if constexpr (kPlanes >= 1) p0 += kLanes;
      if constexpr (kPlanes == 2) p1 += kLanes;
      s0 += s0_step;
      s1 += s1_step;
    }
    if (b1 * kLanes > n && b0 < b1) {  // the tail: the same code on zero-padded copies
      const int64_t i = (b1 - 1) * kLanes, count = n - i;
      alignas(64) uint16_t th[kLanes] = {}, tg[kLanes] = {};
      alignas(64) uint8_t t0[kLanes] = {}, t1[kLanes] = {};
      alignas(64) char ts0[kLanes * 4] = {}, ts1[kLanes * 4] = {};
      uint8_t* const q0 = s.plane0;
      uint8_t* const q1 = s.plane1;
      std::memcpy(th, s.half + i, count * 2);
      std::memcpy(tg, s.grad + i, count * 2);
      if (q0) std::memcpy(t0, q0 + i, count);
      if (q1) std::memcpy(t1, q1 + i, count);
      if (s0_base) std::memcpy(ts0, s0_base + i * kStateSize, count * kStateSize);
      if (s1_base) std::memcpy(ts1, s1_base + i * kStateSize, count * kStateSize);
      block<kExact>(th, tg, t0, t1, ts0, ts1, cl, c5l, hash_seed(static_cast<int32_t>(s.offset + i), s.key), momentum,
                    nesterov, first);
      std::memcpy(s.half + i, th, count * 2);
      if (q0) std::memcpy(q0 + i, t0, count);
      if (q1) std::memcpy(q1 + i, t1, count);
      if (s0_base) std::memcpy(s0_base + i * kStateSize, ts0, count * kStateSize);
      if (s1_base) std::memcpy(s1_base + i * kStateSize, ts1, count * kStateSize);
    }
  }

  // q: 8-bit moments (packed_int8.h), nq of them, stepped in groups of 32 by this fp32-state kernel's block
  static void run(const Step& s, int64_t n, const Quantized* q = nullptr, int nq = 0) {
    fvec c[9];
    for (int j = 0; j < 9; j++) c[j] = fvec(s.c[j]);
    const float c5f = s.c[5];
    const DivideByConstant c5{fvec(c5f), fvec(1.0f / c5f)};
    const bool exact = !WB_DIVIDE_PLAIN && std::isnormal(c5f) && c5f > 0.0f && c5f <= 1.0f;
    if constexpr (!kBf16State) {  // 8-bit moments are stepped as fp32 states
      if (q != nullptr) {
        at::parallel_for(0, (n + kGroup - 1) / kGroup, 32768 / kGroup, [&](int64_t g0, int64_t g1) {
          exact ? quantized_range<Kernel, true>(s, *q, nq, n, g0, g1, c, c5)
                : quantized_range<Kernel, false>(s, *q, nq, n, g0, g1, c, c5);
        });
        return;
      }
    }
    const int64_t blocks = (n + kLanes - 1) / kLanes;
    // NOTE: at least 32768 values per task (ATen's grain size): a small group runs on one thread.
    at::parallel_for(0, blocks, 32768 / kLanes, [&](int64_t b0, int64_t b1) {
      exact ? range<true>(s, n, b0, b1, c, c5) : range<false>(s, n, b0, b1, c, c5);
    });
  }
};

// q (8-bit moments, nq of them; else nullptr) runs the fp32-state kernel (bf16_state false) group by group
template <bool kFp16, int kPlanes, bool kSR, int kMaster, bool kBf16State>
void dispatch_math(const Step& s, int64_t n, int64_t math, const Quantized* q, int nq) {
  if (math == kAdamW) Kernel<kFp16, kPlanes, kSR, kMaster, kBf16State, kAdamW>::run(s, n, q, nq);
  else if (math == kAdam) Kernel<kFp16, kPlanes, kSR, kMaster, kBf16State, kAdam>::run(s, n, q, nq);
  else Kernel<kFp16, kPlanes, kSR, kMaster, kBf16State, kSgd>::run(s, n, q, nq);
}

template <bool kFp16, int kPlanes, bool kSR>
void dispatch_format(const Step& s, int64_t n, int64_t math, int64_t master, bool bf16_state, const Quantized* q,
                     int nq) {
  // with all 16 bits kept (bf16+16) stochastic master rounding has nothing to round: truncate's instantiation
  constexpr bool kHasDropped = 8 * kPlanes - (kSR ? 1 : 0) < (kFp16 ? 13 : 16);
  if constexpr (!kSR) {
    if (master == 2) {
      bf16_state ? dispatch_math<kFp16, kPlanes, kSR, 2, true>(s, n, math, q, nq)
                 : dispatch_math<kFp16, kPlanes, kSR, 2, false>(s, n, math, q, nq);
      return;
    }
  }
  if (kHasDropped && master == 1) {
    bf16_state ? dispatch_math<kFp16, kPlanes, kSR, kHasDropped ? 1 : 0, true>(s, n, math, q, nq)
               : dispatch_math<kFp16, kPlanes, kSR, kHasDropped ? 1 : 0, false>(s, n, math, q, nq);
  } else {
    bf16_state ? dispatch_math<kFp16, kPlanes, kSR, 0, true>(s, n, math, q, nq)
               : dispatch_math<kFp16, kPlanes, kSR, 0, false>(s, n, math, q, nq);
  }
}

// packed_bf16.cpp: the step of the bf16 formats (0, 1 or 2 byte planes, stochastic rounding or not)
void step_bf16(const Step& s, int64_t n, int64_t math, int64_t master, bool bf16_state, int64_t nplanes, bool sr,
               const Quantized* q, int nq);

}  // namespace workbench_packed
