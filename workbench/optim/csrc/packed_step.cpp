// The packed optimizers' fused flat step on CPU, hand-written with ATen's at::vec::Vectorized.
//
// Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (merge
// the 16-bit value with its extra bits, update in fp32, split back; the "Fused" optimizers handle a
// group's parameters as one stream of values). Loaded by workbench/optim/cpu_kernel.py.
//
// NOTE: hand-written rather than left to inductor: the compiled step tiles 16 fp32 lanes against
// mixed fp32/bf16 stores and writes the uint8 byte planes with masked stores, and measured 0.43-0.85x
// of torch.optim.AdamW(fused=True) although it moves fewer bytes. Here one loop reads each byte
// once: 16-bit value + byte planes + states in, the same out, the gradient read once, per segment
// where autograd left it (a fused group's parameters: no flat copy of the gradients).
//
// Every operation mirrors workbench/optim/split_merge.py and update.py (the eager path) in the same
// order, each rounded once (built with -ffp-contract=off: no implicit fused multiply-add), so the
// result is bit-identical to the eager step: int32 arithmetic wraps as torch's does, sqrt is
// correctly rounded (as the eager float64 detour), NaNs are the ones ATen's kernels return (packed_vec.h),
// bf16 states round to nearest even as ATen's float->bf16 copy does, and the random bits are
// rng.hash_noise's hash of (key, offset + index). A tail shorter than one vector runs the same vector
// code on a zero-padded copy.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "packed_kernel.h"

namespace {

using namespace workbench_packed;


void check_flat(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.numel() == n, name, " must be contiguous with ", n, " values, got ",
              t.sizes(), " strides ", t.strides());
}

// The step over `half`'s stream, the gradient given per segment: grads[i] (contiguous, in the segment's
// order) is the gradient of values seg_offsets[i] .. seg_offsets[i] + grads[i].numel() - 1, read where autograd
// left it (no flat copy); values outside every segment are left as they are.
void packed_step(const at::Tensor& half, at::TensorList grads, at::IntArrayRef seg_offsets, at::TensorList planes,
                 at::TensorList states, const at::Tensor& coef, int64_t key, int64_t offset, int64_t extra_bits,
                 bool stochastic_rounding, int64_t master_rounding, int64_t math, bool momentum, bool nesterov,
                 bool first) {
  const int64_t n = half.numel();
  const bool fp16 = half.scalar_type() == at::kHalf;
  TORCH_CHECK(fp16 || half.scalar_type() == at::kBFloat16, "half must be bf16 or fp16, got ", half.scalar_type());
  check_flat(half, "half", half.scalar_type(), n);
  TORCH_CHECK(grads.size() == seg_offsets.size(), "one segment offset per gradient: got ", grads.size(),
              " gradients and ", seg_offsets.size(), " offsets");
  int64_t end = 0;
  for (size_t i = 0; i < grads.size(); i++) {
    TORCH_CHECK(seg_offsets[i] >= end && seg_offsets[i] + grads[i].numel() <= n, "segment ", i, " at ",
                seg_offsets[i], " of ", grads[i].numel(), " values overlaps another or ends past ", n);
    check_flat(grads[i], "grad", half.scalar_type(), grads[i].numel());
    end = seg_offsets[i] + grads[i].numel();
  }
  const int64_t nplanes = static_cast<int64_t>(planes.size());
  // no plane: k = 0 (the 16-bit value alone, nothing to store beside it)
  TORCH_CHECK((nplanes == 1 || (nplanes == 2 && !fp16) || (nplanes == 0 && !stochastic_rounding)) &&
                  extra_bits == 8 * nplanes - (stochastic_rounding ? 1 : 0),
              "byte planes hold 0, 8 or 16 stored bits: got ", nplanes, " planes for ", extra_bits, " extra bits",
              stochastic_rounding ? " + the rounding flag" : "", " of ", half.scalar_type());
  for (const auto& p : planes) check_flat(p, "plane", at::kByte, n);
  TORCH_CHECK(math == kAdamW || math == kAdam || math == kSgd, "math=", math, ": 0 (AdamW), 1 (Adam) or 2 (SGD)");
  TORCH_CHECK(master_rounding >= 0 && master_rounding <= 2 && !(master_rounding == 2 && stochastic_rounding),
              "master_rounding=", master_rounding, ": 0 (truncate), 1 (stochastic) or 2 (nearest, not with stochastic "
              "rounding)");
  int64_t nstates = static_cast<int64_t>(states.size());
  const int64_t want = math == kSgd ? (momentum ? 1 : 0) : 2;
  // 8-bit moments: (codes, bf16 scales) per state, codes int8 (first moment, momentum) or uint8 (second moment)
  const bool quantized = nstates > 0 && (states[0].scalar_type() == at::kChar || states[0].scalar_type() == at::kByte);
  Quantized q{};
  if (quantized) {
    TORCH_CHECK(nstates == 2 * want, "expected ", want, " pairs of 8-bit codes and scales, got ", nstates, " tensors");
    for (int64_t m = 0; m < want; m++) {
      const auto kind = states[2 * m].scalar_type();
      TORCH_CHECK(kind == (math != kSgd && m == 1 ? at::kByte : at::kChar), "8-bit state ", m, " has codes of ", kind);
      check_flat(states[2 * m], "codes", kind, n);
      check_flat(states[2 * m + 1], "scales", at::kBFloat16, (n + kGroup - 1) / kGroup);
      q.kind[m] = kind == at::kByte ? 1 : 0;
    }
    for (size_t i = 0; i < grads.size(); i++) {
      TORCH_CHECK(seg_offsets[i] % kGroup == 0, "8-bit moments: segment ", i, " starts at ", seg_offsets[i],
                  ", not on a group of ", kGroup);
    }
    nstates = 0;
  }
  TORCH_CHECK(quantized || nstates == want, "expected ", want, " state tensors, got ", nstates);
  const bool bf16_state = nstates > 0 && states[0].scalar_type() == at::kBFloat16;
  if (!quantized) {
    for (const auto& t : states) check_flat(t, "state", bf16_state ? at::kBFloat16 : at::kFloat, n);
  }
  const int64_t ncoef = math == kSgd ? 4 : 9;
  check_flat(coef, "coef", at::kFloat, ncoef);
  const int64_t state_size = bf16_state ? 2 : 4;
  const float* c = coef.data_ptr<float>();
  const bool sr = stochastic_rounding;
  const int64_t ms = master_rounding;
  for (size_t i = 0; i < grads.size(); i++) {
    const int64_t at = seg_offsets[i], len = grads[i].numel();
    if (len == 0) continue;
    Step s{};
    s.half = reinterpret_cast<uint16_t*>(half.data_ptr()) + at;
    s.grad = reinterpret_cast<const uint16_t*>(grads[i].data_ptr());
    s.plane0 = nplanes >= 1 ? planes[0].data_ptr<uint8_t>() + at : nullptr;
    s.plane1 = nplanes == 2 ? planes[1].data_ptr<uint8_t>() + at : nullptr;
    s.state0 = nstates > 0 ? static_cast<char*>(states[0].data_ptr()) + at * state_size : nullptr;
    s.state1 = nstates > 1 ? static_cast<char*>(states[1].data_ptr()) + at * state_size : nullptr;
    Quantized qs = q;  // this segment's codes and scales
    for (int64_t m = 0; quantized && m < want; m++) {
      qs.codes[m] = static_cast<char*>(states[2 * m].data_ptr()) + at;
      qs.scales[m] = reinterpret_cast<uint16_t*>(states[2 * m + 1].data_ptr()) + at / kGroup;
    }
    const Quantized* qp = quantized ? &qs : nullptr;
    const int nq = quantized ? static_cast<int>(want) : 0;
    for (int64_t j = 0; j < ncoef; j++) s.c[j] = c[j];
    s.key = static_cast<int32_t>(static_cast<uint32_t>(key));
    s.offset = offset + at;  // the random bits of value j are the stream's at offset + j
    s.momentum = momentum;
    s.nesterov = nesterov;
    s.first = first;
    if (!fp16) {
      step_bf16(s, len, math, ms, bf16_state, nplanes, sr, qp, nq);  // packed_bf16.cpp
    } else if (nplanes == 0) {
      dispatch_format<true, 0, false>(s, len, math, ms, bf16_state, qp, nq);
    } else {
      sr ? dispatch_format<true, 1, true>(s, len, math, ms, bf16_state, qp, nq)
         : dispatch_format<true, 1, false>(s, len, math, ms, bf16_state, qp, nq);
    }
  }
}

int64_t lanes() { return kLanes; }

}  // namespace

// NOTE: the op namespace is the build's name (cpp_extension defines TORCH_EXTENSION_NAME), so several variants
// load side by side in one process (the tuning run, the tests); the indirection expands the macro first.
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME workbench_packed_cpu
#endif
#define WB_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define WB_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

WB_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def(
      "step(Tensor(a!) half, Tensor[] grads, int[] seg_offsets, Tensor(b!)[] planes, Tensor(c!)[] states, "
      "Tensor coef, int key, "
      "int offset, int extra_bits, bool stochastic_rounding, int master_rounding, int math, bool momentum, "
      "bool nesterov, bool first) -> ()");
  m.def("lanes() -> int", &lanes);
}

WB_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("step", &packed_step); }
