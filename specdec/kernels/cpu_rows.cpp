// Short-block linear for x86 CPUs with AVX2 + FMA: y [n, out] = x [n, in] @ w [out, in]^T (+ bias), for the
// 1 to 16 rows of a decode, draft or verification step, float32 or bfloat16 weights.
//
// Why (specdec/kernels/cpu_rows.py has the measurements): the BLAS torch calls is built for big blocks. A
// short block is a stream of the weights past a few rows of x, so its speed is the speed the weights are
// read at; here every weight row is read once, 1 to 4 rows of it at a time, against up to 8 rows of x
// held in registers (more rows: the next 8 re-read the weight rows while they are still in L1), the
// output rows split between torch's intra-op threads. bfloat16 weights are widened to float32 in
// registers (a shift: bfloat16 is float32's top half), so a bfloat16 model reads half the bytes.
// Accumulation is float32 in 4 x 8 lanes; the result differs from the BLAS's in the last bits (another
// summation order), as the BLAS's own k-row and 1-row products differ from each other.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_rows.h"

namespace {

using specdec_cpu::product;

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rows_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "rows_linear: x [n, in] and weight [out, in], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "rows_linear: x and weight both float32 or both bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rows_linear: the weight must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "rows_linear: bias [out], got ", bias->sizes());
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  specdec_cpu::with_float_type(weight.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    product(xf.data_ptr<float>(), weight.data_ptr<T>(), b, out.data_ptr<T>(), M, N, K);
  });
  return out;
}

// Whether bfloat16 products take cpu_rows_bf16.h's AVX512-BF16 path from now on (on: only where the CPU has
// the instructions; cpu_library.py's loader asks /proc/cpuinfo): the setting now in effect, false wherever the
// compiler could not build the path.
bool set_bf16_dot(bool on) {
  specdec_cpu::bf16_dot_enabled() = on && SPECDEC_BF16_DOT;
  return specdec_cpu::bf16_dot_enabled();
}

bool bf16_dot() { return specdec_cpu::bf16_dot_enabled(); }

}  // namespace

TORCH_LIBRARY(specdec_cpu, m) {
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("set_bf16_dot(bool on) -> bool", &set_bf16_dot);
  m.def("bf16_dot() -> bool", &bf16_dot);
}
TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
