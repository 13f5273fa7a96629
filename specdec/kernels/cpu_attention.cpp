// One layer's attention over the paged KV for the few queries of a decode or verification step, on x86 CPUs
// with AVX2 + FMA: write the new tokens' keys and values into their slots, then every query head attends
// over the keys its row may see (mask) through the slots the step reads.
//
// Why (specdec/kernels/cpu_attention.py has the measurements): the step between two compiled graphs did this
// as a dozen small torch ops (transposes, the page write, the page view, the mask, SDPA and its reshapes),
// about 100-150 us a layer of dispatch for a few microseconds of arithmetic. Here: one call.
// Arithmetic in float32 (bfloat16 keys, values and queries widened in registers); scores, softmax and the
// weighted sum per (query row, KV group: its heads read each key and value once together), split between
// torch's intra-op threads when there is enough of it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "cpu_attention.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using specdec_cpu::attend_all;

// Writes k_new, v_new [n, Hkv, D] to k_pages, v_pages [S, Hkv, D] at write_slots [n]; returns the attention of
// q [n, Hq, D] over the slots read_slots [T] (mask [n, T] bool: may row i see key t; None: every key) as
// [n, Hq * D] in q's dtype.
at::Tensor attend_pages(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_pages,
                        at::Tensor& v_pages, const at::Tensor& write_slots, const at::Tensor& read_slots,
                        const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_pages.device().is_cpu(), "attend_pages: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3 && k_pages.dim() == 3 && v_pages.dim() == 3,
              "attend_pages: q [n, Hq, D], k_new, v_new [n, Hkv, D], k_pages, v_pages [S, Hkv, D]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pages.size(1), Tk = read_slots.numel();
  TORCH_CHECK(k_new.sizes() == v_new.sizes() && k_new.size(0) == n && k_new.size(1) == Hkv && k_new.size(2) == D &&
                  k_pages.sizes() == v_pages.sizes() && k_pages.size(2) == D && Hq % Hkv == 0,
              "attend_pages: shapes disagree: q ", q.sizes(), ", k_new ", k_new.sizes(), ", v_new ", v_new.sizes(),
              ", k_pages ", k_pages.sizes(), ", v_pages ", v_pages.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k_new.scalar_type() == dt && v_new.scalar_type() == dt &&
                  k_pages.scalar_type() == dt && v_pages.scalar_type() == dt,
              "attend_pages: every tensor float32, or every tensor bfloat16");
  specdec_cpu::check_pages("attend_pages", k_pages, v_pages, write_slots, read_slots, mask, n, D, dt);
  const at::Tensor ws = write_slots.contiguous(), rs = read_slots.contiguous();
  const int64_t row = Hkv * D;
  const int64_t* w = ws.data_ptr<int64_t>();
  const int64_t* r = rs.data_ptr<int64_t>();
  // the new keys and values, row by row (k_new may be any strided view, e.g. a slice of a graph's output)
  const at::Tensor kn = k_new.contiguous(), vn = v_new.contiguous(), qc = q.contiguous();
  const at::Tensor mc = mask.has_value() ? mask->contiguous() : at::Tensor();
  at::Tensor out = at::empty({n, Hq * D}, q.options());
  if (n == 0) return out;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    specdec_cpu::write_slots(k_pages.data_ptr<T>(), kn.data_ptr<T>(), w, n, row);
    specdec_cpu::write_slots(v_pages.data_ptr<T>(), vn.data_ptr<T>(), w, n, row);
    attend_all(qc.data_ptr<T>(), k_pages.data_ptr<T>(), v_pages.data_ptr<T>(), r,
               mask.has_value() ? mc.data_ptr<bool>() : nullptr, float(scale), out.data_ptr<T>(), n, Hq, Hkv, D, Tk);
  };
  specdec_cpu::with_float_type(dt, run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) {
  m.def("attend_pages(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_pages, Tensor(b!) v_pages, "
        "Tensor write_slots, Tensor read_slots, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) { m.impl("attend_pages", &attend_pages); }
