// One Llama-family decoder layer over the 1 to 32 tokens of a decode or verification step, in one call, on x86
// CPUs with AVX2 + FMA: input norm, q / k / v (+ biases), RoPE, the KV page write and attention, o, residual,
// post-attention norm, gate / up, SiLU x up, down, residual. Optionally the parts Qwen3 and Gemma 3 add
// (hf/lean_layer.py LayerForm): per-head q / k norms before RoPE, Gemma's sandwich norms (the attention's and
// the MLP's outputs normed before their residual adds), Gemma's (1 + w) norms, GELU (tanh) for SiLU.
//
// Why (specdec/kernels/cpu_layer.py has the measurements): the compiled step (hf/compiled.py) ran a layer as
// an inductor graph plus the attention kernel between graphs; with the products already at the memory's
// pace, what was left was the machinery around them: a graph call's guards, wrapper and Python op calls,
// about 150-200 us a layer, 5-6 ms of a 30 ms SmolLM2 step. Here a layer is one op call.
//
// Rounding: every value that the graphs (and HF's modules) store in the model's dtype is rounded to it here
// at the same point (norm outputs, each product, RoPE, attention, residual sums, SiLU x up); arithmetic in
// between is float32, as inductor's fused loops do it. Products through cpu_rows.h (each weight row read once
// for every row of x), attention through cpu_attention.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "cpu_attention.h"
#include "cpu_rows.h"

namespace {

template <typename T>
inline float rnd(float v) {  // v rounded to T (identity for float)
  return static_cast<float>(T(v));
}

// p [count] rounded to T in place (nothing for float), 8 lanes at a time
template <typename T>
void round_all(float* p, int64_t count) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(p + j, specdec_cpu::round8<T>(_mm256_loadu_ps(p + j)));
    for (; j < count; j++) p[j] = rnd<T>(p[j]);
  }
}

// x [count] = x + y, rounded to T (a residual sum)
template <typename T>
void add_rounded(float* x, const float* y, int64_t count) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8)
    _mm256_storeu_ps(x + j, specdec_cpu::round8<T>(_mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j))));
  for (; j < count; j++) x[j] = rnd<T>(x[j] + y[j]);
}

// t's values (of type T, any layout) widened to float32 in dst [t.numel()]
template <typename T>
void widen_all(const at::Tensor& t, float* dst) {
  const at::Tensor c = t.contiguous();
  const T* p = c.data_ptr<T>();  // (data_ptr checks the tensor on every call: once, not per element)
  for (int64_t j = 0; j < c.numel(); j++) dst[j] = specdec_cpu::widen(p[j]);
}

// out (contiguous, of type T) = src [out.numel()] converted to T
template <typename T>
void store_all(const float* src, at::Tensor& out) {
  T* p = out.data_ptr<T>();
  for (int64_t j = 0; j < out.numel(); j++) p[j] = T(src[j]);
}

// out [n, H] = w * (x / rms(x)) row by row, HF's RMSNorm: the normalised row rounded to T, then times w;
// offset (Gemma's norm): (x / rms(x)) * (1 + w) in float32, rounded once. out may be x.
template <typename T>
void rms_norm(const float* x, const T* w, float* out, int64_t n, int64_t H, float eps, bool offset = false) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i++) {
    const float* xi = x + i * H;
    float ss = 0.f;
    for (int64_t j = 0; j < H; j++) ss += xi[j] * xi[j];
    const float r = 1.f / std::sqrt(ss / H + eps);
    const __m256 rv = _mm256_set1_ps(r);
    int64_t j = 0;
    for (; j + 8 <= H; j += 8) {
      const __m256 xr = _mm256_mul_ps(_mm256_loadu_ps(xi + j), rv);
      const __m256 y = offset ? _mm256_mul_ps(xr, _mm256_add_ps(one, specdec_cpu::load8(w + j)))
                              : _mm256_mul_ps(specdec_cpu::load8(w + j), specdec_cpu::round8<T>(xr));
      _mm256_storeu_ps(out + i * H + j, specdec_cpu::round8<T>(y));
    }
    for (; j < H; j++)
      out[i * H + j] = offset ? rnd<T>(xi[j] * r * (1.f + specdec_cpu::widen(w[j])))
                              : rnd<T>(specdec_cpu::widen(w[j]) * rnd<T>(xi[j] * r));
  }
}

// ys[i] [n, N_i] = x [n, K] @ ws[i] [N_i, K]^T (+ biases[i]), rounded to T: every weight in one parallel region
template <typename T>
void linears(const float* x, std::initializer_list<const at::Tensor*> ws,
             std::initializer_list<const std::optional<at::Tensor>*> biases, std::initializer_list<float*> ys,
             int64_t n) {
  std::vector<specdec_cpu::Segment<T, float>> segments;
  std::vector<std::vector<float>> widened(ws.size());
  auto bias = biases.begin();
  auto y = ys.begin();
  size_t i = 0;
  for (const at::Tensor* w : ws) {
    const std::optional<at::Tensor>* b = bias == biases.end() ? nullptr : *bias++;
    if (b && b->has_value()) {
      const T* bp = (*b)->data_ptr<T>();
      widened[i].resize(w->size(0));
      for (int64_t j = 0; j < w->size(0); j++) widened[i][j] = specdec_cpu::widen(bp[j]);
    }
    segments.push_back({w->data_ptr<T>(), widened[i].empty() ? nullptr : widened[i].data(), *y++, w->size(0)});
    i++;
  }
  specdec_cpu::product_segments(x, segments.data(), segments.size(), n, (*ws.begin())->size(1));
  for (const auto& s : segments) round_all<T>(s.out, n * s.N);
}

// x [n, heads, D] = x * cos + roll(x, D / 2) * signed_sin (hf/lean.py's rope; cos, sin [n, D]), rounded to T;
// 8 lanes at a time where D / 2 is a multiple of 8 (the rolled lanes then never wrap inside a vector)
template <typename T>
void rope(float* x, const T* cos, const T* sin, int64_t n, int64_t heads, int64_t D) {
  using specdec_cpu::load8;
  using specdec_cpu::round8;
  std::vector<float> row(D);
  const int64_t half = D / 2;
  for (int64_t i = 0; i < n; i++)
    for (int64_t h = 0; h < heads; h++) {
      float* xr = x + (i * heads + h) * D;
      std::copy_n(xr, D, row.data());
      int64_t d = 0;
      if (half % 8 == 0)
        for (; d < D; d += 8) {
          const __m256 a = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row.data() + d), load8(cos + i * D + d)));
          const __m256 b = round8<T>(_mm256_mul_ps(_mm256_loadu_ps(row.data() + (d + half) % D), load8(sin + i * D + d)));
          _mm256_storeu_ps(xr + d, round8<T>(_mm256_add_ps(a, b)));
        }
      for (; d < D; d++) {
        const float rolled = row[(d + half) % D];
        xr[d] = rnd<T>(rnd<T>(row[d] * specdec_cpu::widen(cos[i * D + d])) +
                       rnd<T>(rolled * specdec_cpu::widen(sin[i * D + d])));
      }
    }
}

// g [m] = silu(g) * u, each rounded to T (HF: act(gate) * up)
template <typename T>
void silu_times(float* g, const float* u, int64_t m) {
  using specdec_cpu::round8;
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = specdec_cpu::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 act = round8<T>(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    _mm256_storeu_ps(g + j, round8<T>(_mm256_mul_ps(act, _mm256_loadu_ps(u + j))));
  }
  for (; j < m; j++) g[j] = rnd<T>(rnd<T>(g[j] / (1.f + std::exp(-g[j]))) * u[j]);
}

// g [m] = gelu_tanh(g) * u, each rounded to T (torch's GELU, approximate="tanh":
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(y) as 1 - 2 / (e^2y + 1))
template <typename T>
void gelu_tanh_times(float* g, const float* u, int64_t m) {
  using specdec_cpu::round8;
  constexpr float beta = 0.7978845608028654f, kappa = 0.044715f;
  const __m256 b = _mm256_set1_ps(beta), c = _mm256_set1_ps(kappa), one = _mm256_set1_ps(1.f),
               two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256 xv = _mm256_loadu_ps(g + j);
    const __m256 inner = _mm256_mul_ps(b, _mm256_fmadd_ps(_mm256_mul_ps(c, xv), _mm256_mul_ps(xv, xv), xv));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(specdec_cpu::exp8(_mm256_mul_ps(two, inner)), one)));
    const __m256 act = round8<T>(_mm256_mul_ps(_mm256_mul_ps(half, xv), _mm256_add_ps(one, t)));
    _mm256_storeu_ps(g + j, round8<T>(_mm256_mul_ps(act, _mm256_loadu_ps(u + j))));
  }
  for (; j < m; j++) {
    const float x = g[j];
    g[j] = rnd<T>(rnd<T>(0.5f * x * (1.f + std::tanh(beta * (x + kappa * x * x * x)))) * u[j]);
  }
}

// What a layer does beyond Llama's (null / false: nothing): per-head q / k norms [D] before RoPE; Gemma's
// sandwich norms [H] over the attention's and the MLP's outputs before their residual adds; every norm
// Gemma's (1 + w) form; GELU (tanh) for SiLU
template <typename T>
struct Extras {
  const T* q_norm = nullptr;
  const T* k_norm = nullptr;
  const T* attn_out_norm = nullptr;
  const T* mlp_out_norm = nullptr;
  bool offset = false;
  bool gelu_tanh = false;
};

template <typename T>
void layer(float* x, const std::vector<at::Tensor>& w, const std::vector<std::optional<at::Tensor>>& bias,
           const T* cos, const T* sin, T* k_pages, T* v_pages, const int64_t* write, const int64_t* read,
           const bool* mask, int64_t n, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t D, float scale, float eps,
           const float* qkv_in, const Extras<T>& ex) {
  const int64_t H = w[4].size(0), I = w[6].size(0), row = Hkv * D;
  std::vector<float> h(n * H), q(n * Hq * D), k(n * row), v(n * row), att(n * Hq * D), g(n * I), u(n * I), o(n * H);
  if (!qkv_in) rms_norm(x, w[0].data_ptr<T>(), h.data(), n, H, eps, ex.offset);
  linears<T>(qkv_in ? qkv_in : h.data(), {&w[1], &w[2], &w[3]}, {&bias[0], &bias[1], &bias[2]},
             {q.data(), k.data(), v.data()}, n);
  if (ex.q_norm) {
    rms_norm(q.data(), ex.q_norm, q.data(), n * Hq, D, eps, ex.offset);
    rms_norm(k.data(), ex.k_norm, k.data(), n * Hkv, D, eps, ex.offset);
  }
  rope(q.data(), cos, sin, n, Hq, D);
  rope(k.data(), cos, sin, n, Hkv, D);
  specdec_cpu::write_slots(k_pages, k.data(), write, n, row);
  specdec_cpu::write_slots(v_pages, v.data(), write, n, row);
  specdec_cpu::attend_all(q.data(), k_pages, v_pages, read, mask, scale, att.data(), n, Hq, Hkv, D, Tk);
  round_all<T>(att.data(), n * Hq * D);
  linears<T>(att.data(), {&w[4]}, {}, {o.data()}, n);
  if (ex.attn_out_norm) rms_norm(o.data(), ex.attn_out_norm, o.data(), n, H, eps, ex.offset);
  add_rounded<T>(x, o.data(), n * H);
  rms_norm(x, w[5].data_ptr<T>(), h.data(), n, H, eps, ex.offset);
  linears<T>(h.data(), {&w[6], &w[7]}, {}, {g.data(), u.data()}, n);
  if (ex.gelu_tanh)
    gelu_tanh_times<T>(g.data(), u.data(), n * I);
  else
    silu_times<T>(g.data(), u.data(), n * I);
  linears<T>(g.data(), {&w[8]}, {}, {o.data()}, n);
  if (ex.mlp_out_norm) rms_norm(o.data(), ex.mlp_out_norm, o.data(), n, H, eps, ex.offset);
  add_rounded<T>(x, o.data(), n * H);
}

// x [n, H] -> the layer's output [n, H] (x's dtype); weights: input norm [H], q [Hq*D, K], k, v [Hkv*D, K],
// o [H, Hq*D], post-attention norm [H], gate, up [I, H], down [H, I]; qkv_bias: q, k, v biases or None;
// cos, sin [n, D] (sin's first half negated); k_pages, v_pages [S, Hkv, D] get the new tokens' keys and
// values at write_slots [n]; the queries read read_slots [T] under mask [n, T] (None: every key).
// qkv_input [n, K] or None: what q, k and v multiply, given by the caller (EAGLE-3's midlayer: its embedding
// and hidden normalised side by side, K = 2H; the input norm is then not applied); None: the input norm of x
// (K = H). q_norm, k_norm [D] (both or neither): per-head norms of q and k before RoPE (Qwen3, Gemma 3);
// attn_out_norm, mlp_out_norm [H] (both or neither): Gemma's sandwich norms, the post-attention weight then
// being the pre-feedforward norm; offset_norms: every norm Gemma's (1 + w) form; activation "silu" or
// "gelu_pytorch_tanh".
at::Tensor decoder_layer(const at::Tensor& x, at::TensorList weights, at::ArrayRef<std::optional<at::Tensor>> qkv_bias,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_pages, at::Tensor& v_pages,
                         const at::Tensor& write_slots, const at::Tensor& read_slots,
                         const std::optional<at::Tensor>& mask, double scale, double eps, int64_t heads,
                         int64_t kv_heads, const std::optional<at::Tensor>& qkv_input,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                         const std::optional<at::Tensor>& attn_out_norm, const std::optional<at::Tensor>& mlp_out_norm,
                         bool offset_norms, c10::string_view activation) {
  const char* op = "decoder_layer";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, op, ": x [n, H] on the CPU, got ", x.sizes());
  TORCH_CHECK(weights.size() == 9 && qkv_bias.size() == 3, op, ": 9 weights and 3 q/k/v biases, got ",
              weights.size(), " and ", qkv_bias.size());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": float32 or bfloat16, got ", dt);
  const int64_t n = x.size(0), H = x.size(1), D = k_pages.dim() == 3 ? k_pages.size(2) : 0, I = weights[6].size(0);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && k_pages.dim() == 3 && k_pages.size(1) == kv_heads,
              op, ": heads a multiple of kv_heads, the pages [S, kv_heads, D]");
  TORCH_CHECK(!qkv_input.has_value() || (qkv_input->dim() == 2 && qkv_input->size(0) == n &&
                                          qkv_input->scalar_type() == dt), op, ": qkv_input [n, K] of x's dtype");
  const int64_t K = qkv_input.has_value() ? qkv_input->size(1) : H;
  const std::vector<std::vector<int64_t>> shapes = {{H}, {heads * D, K}, {kv_heads * D, K}, {kv_heads * D, K},
                                                    {H, heads * D}, {H}, {I, H}, {I, H}, {H, I}};
  const char* names[] = {"input norm", "q", "k", "v", "o", "post-attention norm", "gate", "up", "down"};
  for (size_t j = 0; j < 9; j++) {
    TORCH_CHECK(weights[j].sizes() == at::IntArrayRef(shapes[j]), op, ": the ", names[j], " weight should be ",
                at::IntArrayRef(shapes[j]), ", got ", weights[j].sizes());
    TORCH_CHECK(weights[j].scalar_type() == dt && weights[j].is_contiguous(), op, ": the ", names[j],
                " weight should be contiguous and of x's dtype");
  }
  for (size_t j = 0; j < 3; j++)
    if (qkv_bias[j].has_value())
      TORCH_CHECK(qkv_bias[j]->numel() == weights[1 + j].size(0) && qkv_bias[j]->scalar_type() == dt &&
                      qkv_bias[j]->is_contiguous(), op, ": the ", names[1 + j], " bias should be [",
                  weights[1 + j].size(0), "] of x's dtype");
  TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", op,
              ": activation \"silu\" or \"gelu_pytorch_tanh\", got \"", std::string(activation), "\"");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() && attn_out_norm.has_value() == mlp_out_norm.has_value(), op,
              ": q_norm and k_norm both or neither, attn_out_norm and mlp_out_norm both or neither");
  const std::pair<const std::optional<at::Tensor>*, std::pair<const char*, int64_t>> norms[] = {
      {&q_norm, {"q_norm", D}}, {&k_norm, {"k_norm", D}}, {&attn_out_norm, {"attn_out_norm", H}},
      {&mlp_out_norm, {"mlp_out_norm", H}}};
  for (const auto& [t, what] : norms)
    if (t->has_value())
      TORCH_CHECK((*t)->sizes() == at::IntArrayRef({what.second}) && (*t)->scalar_type() == dt &&
                      (*t)->is_contiguous(), op, ": ", what.first, " should be [", what.second,
                  "], contiguous, of x's dtype, got ", (*t)->sizes());
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({n, D}) && sin.sizes() == cos.sizes() && cos.scalar_type() == dt &&
                  sin.scalar_type() == dt, op, ": cos, sin [n, D] of x's dtype, got ", cos.sizes());
  specdec_cpu::check_pages(op, k_pages, v_pages, write_slots, read_slots, mask, n, D, dt);
  at::Tensor out = at::empty({n, H}, x.options());
  if (n == 0) return out;
  const at::Tensor ws = write_slots.contiguous(), rs = read_slots.contiguous(), cc = cos.contiguous(),
                   sc = sin.contiguous();
  const at::Tensor mc = mask.has_value() ? mask->contiguous() : at::Tensor();
  std::vector<at::Tensor> w(weights.begin(), weights.end());
  std::vector<std::optional<at::Tensor>> b(qkv_bias.begin(), qkv_bias.end());
  std::vector<float> xf(n * H), hf(qkv_input.has_value() ? n * K : 0);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    widen_all<T>(x, xf.data());
    if (qkv_input.has_value()) widen_all<T>(*qkv_input, hf.data());
    auto ptr = [](const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<T>() : nullptr; };
    const Extras<T> ex{ptr(q_norm), ptr(k_norm), ptr(attn_out_norm), ptr(mlp_out_norm), offset_norms,
                       activation == "gelu_pytorch_tanh"};
    layer<T>(xf.data(), w, b, cc.data_ptr<T>(), sc.data_ptr<T>(), k_pages.data_ptr<T>(), v_pages.data_ptr<T>(),
             ws.data_ptr<int64_t>(), rs.data_ptr<int64_t>(), mask.has_value() ? mc.data_ptr<bool>() : nullptr, n,
             read_slots.numel(), heads, kv_heads, D, float(scale), float(eps), hf.empty() ? nullptr : hf.data(), ex);
    store_all<T>(xf.data(), out);
  };
  specdec_cpu::with_float_type(dt, run);
  return out;
}

// x [n, H] -> each row's RMS norm times weight [H] (rms_norm above; offset_norms: Gemma's (1 + w) form), in
// x's dtype: the final norm before the LM head, one call where it was six torch ops on a row (0.2 ms of a
// 12 ms SmolLM2 bfloat16 step)
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset_norms) {
  const char* op = "rms_norm_rows";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, op, ": x [n, H] on the CPU, got ", x.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": float32 or bfloat16, got ", dt);
  TORCH_CHECK(weight.sizes() == at::IntArrayRef({x.size(1)}) && weight.scalar_type() == dt && weight.is_contiguous(),
              op, ": weight [", x.size(1), "], contiguous, of x's dtype, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t n = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({n, H}, x.options());
  std::vector<float> xf(n * H);
  specdec_cpu::with_float_type(dt, [&](auto zero) {
    using T = decltype(zero);
    widen_all<T>(x, xf.data());
    rms_norm(xf.data(), weight.data_ptr<T>(), xf.data(), n, H, float(eps), offset_norms);
    store_all<T>(xf.data(), out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor[] weights, Tensor?[] qkv_bias, Tensor cos, Tensor sin, Tensor(a!) k_pages, "
        "Tensor(b!) v_pages, Tensor write_slots, Tensor read_slots, Tensor? mask, float scale, float eps, int heads, "
        "int kv_heads, Tensor? qkv_input=None, Tensor? q_norm=None, Tensor? k_norm=None, Tensor? attn_out_norm=None, "
        "Tensor? mlp_out_norm=None, bool offset_norms=False, str activation=\"silu\") -> Tensor");
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps, bool offset_norms=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec_cpu, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
  m.impl("rms_norm_rows", &rms_norm_rows);
}
