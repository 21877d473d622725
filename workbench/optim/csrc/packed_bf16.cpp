// The packed CPU step of the bf16 formats (bf16+0, bf16+8, bf16+16, and bf16+7 / bf16+15 with stochastic rounding):
// packed_kernel.h's templates instantiated in a translation unit of their own, compiled beside packed_step.cpp's,
// which holds the fp16 ones (see packed_kernel.h).
#include "packed_kernel.h"

namespace workbench_packed {

void step_bf16(const Step& s, int64_t n, int64_t math, int64_t master, bool bf16_state, int64_t nplanes, bool sr,
               const Quantized* q, int nq) {
  if (nplanes == 0) {
    dispatch_format<false, 0, false>(s, n, math, master, bf16_state, q, nq);
  } else if (nplanes == 1) {
    sr ? dispatch_format<false, 1, true>(s, n, math, master, bf16_state, q, nq)
       : dispatch_format<false, 1, false>(s, n, math, master, bf16_state, q, nq);
  } else {
    sr ? dispatch_format<false, 2, true>(s, n, math, master, bf16_state, q, nq)
       : dispatch_format<false, 2, false>(s, n, math, master, bf16_state, q, nq);
  }
}

}  // namespace workbench_packed
