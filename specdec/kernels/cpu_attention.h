// One layer's attention over the paged KV as templates, for cpu_attention.cpp's op and cpu_layer.cpp's decoder
// layer: every query row's heads over the slots it reads, the Hq / Hkv heads of a KV group together.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace specdec_cpu {

// e^x for 8 floats (x clamped to [-87.3, 88.3], where float32 holds e^x normal), Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2,
// e^r by a degree-6 polynomial, 2^k through the exponent bits: a few float32 ulp from std::exp (the tests
// hold the attention to SDPA's within 1e-5 relative).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));  // e^x's float32 range
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// the 8 lane sums of a[0..7], as one vector (lane j: the sum of a[j]'s lanes)
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: [0123 low halves | 0123 high halves] and the same for 4567
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[t] = q . k_t for the keys at k[t], t < Tk (D % 8 == 0, q float32): eight keys at a time, each its
// own accumulator, reduced together
template <typename T>
void dots(const float* q, const T* const* k, float* scores, int64_t Tk, int64_t D) {
  int64_t t = 0;
  for (; t + 8 <= Tk; t += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, load8(k[t + j] + d), acc[j]);
    }
    _mm256_storeu_ps(scores + t, hsum8(acc));
  }
  for (; t < Tk; t++) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k[t] + d), acc);
    scores[t] = hsum(acc);
  }
}

// out[C * 8] += sum_t p[t] v_t[0, C * 8) over t < Tk, out held in C registers
template <int C, typename T>
void add_weighted_lanes(const float* p, const T* const* v, float* out, int64_t Tk) {
  __m256 acc[C];
  for (int c = 0; c < C; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);
  for (int64_t t = 0; t < Tk; t++) {
    const __m256 pv = _mm256_set1_ps(p[t]);
    for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(pv, load8(v[t] + 8 * c), acc[c]);
  }
  for (int c = 0; c < C; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// out[D] += sum_t p[t] v_t over t < Tk (D % 8 == 0), 64 lanes at a time
template <typename T>
void add_weighted(const float* p, const T* const* v, float* out, int64_t Tk, int64_t D) {
  std::vector<const T*> shifted;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const T* const* vv = v;
    if (d0) {  // the same rows, d0 lanes on
      shifted.resize(Tk);
      for (int64_t t = 0; t < Tk; t++) shifted[t] = v[t] + d0;
      vv = shifted.data();
    }
    switch (std::min<int64_t>(64, D - d0) / 8) {
      case 1: add_weighted_lanes<1>(p, vv, out + d0, Tk); break;
      case 2: add_weighted_lanes<2>(p, vv, out + d0, Tk); break;
      case 3: add_weighted_lanes<3>(p, vv, out + d0, Tk); break;
      case 4: add_weighted_lanes<4>(p, vv, out + d0, Tk); break;
      case 5: add_weighted_lanes<5>(p, vv, out + d0, Tk); break;
      case 6: add_weighted_lanes<6>(p, vv, out + d0, Tk); break;
      case 7: add_weighted_lanes<7>(p, vv, out + d0, Tk); break;
      default: add_weighted_lanes<8>(p, vv, out + d0, Tk); break;
    }
  }
}

// sc[t] = e^(sc[t] - max) over the keys row i may see (m[t]; m null: all), 0 for the others; returns the sum
// and sets *max (-inf, every sc[t] 0 and the sum 0, where the row may see none of these keys)
inline float softmax_numerators(float* sc, const bool* m, int64_t Tk, float* max) {
  const float lowest = -std::numeric_limits<float>::infinity();
  if (m)
    for (int64_t t = 0; t < Tk; t++)
      if (!m[t]) sc[t] = lowest;
  __m256 top8 = _mm256_set1_ps(lowest);
  int64_t t = 0;
  for (; t + 8 <= Tk; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = lanes[0];
  for (int j = 1; j < 8; j++) top = std::max(top, lanes[j]);
  for (; t < Tk; t++) top = std::max(top, sc[t]);
  *max = top;
  if (top == lowest) {
    std::fill(sc, sc + Tk, 0.f);
    return 0.f;
  }
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= Tk; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(top)));
    _mm256_storeu_ps(sc + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum(sum8);
  for (; t < Tk; t++) total += (sc[t] = std::exp(sc[t] - top));
  if (m) {  // e^-inf computed by exp8 is its clamp's tiny value, not 0: the masked keys weigh exactly nothing
    total = 0.f;
    for (t = 0; t < Tk; t++) total += (sc[t] = m[t] ? sc[t] : 0.f);
  }
  return total;
}

constexpr int64_t KEY_BLOCK = 32;  // keys read from the pages once per block, then from L1 by every head of the group
constexpr int64_t PART_KEYS = 256;  // keys a part where a pair's keys are split between threads

// Every (query row i, KV group g) pair: the group's Hq / Hkv heads attend together, so each key and value
// row comes from memory once for all of them. Where few pairs read many keys (a decode step: one row, Hkv
// pairs, a long context), each pair's keys are split into parts attended in parallel, each part with its own
// max, sum and weighted values, merged after (flash-decoding): SmolLM2 one token over 800 keys ran on one
// thread for 3 pairs.
template <typename T, typename Q, typename O>
void attend_all(const Q* q, const T* kc, const T* vc, const int64_t* read, const bool* mask, float scale, O* out,
                int64_t n, int64_t Hq, int64_t Hkv, int64_t D, int64_t Tk) {
  const int64_t group = Hq / Hkv, row = Hkv * D, pairs = n * Hkv;  // row: a slot's stride in the pages
  const int64_t pair_work = std::max<int64_t>(Tk * D * 2 * group, 1);
  // keys a part: PART_KEYS where few pairs read many keys, else all (a split set by the shapes alone, so the
  // numbers do not change with the thread count)
  const int64_t span = pairs < 8 && Tk >= 2 * PART_KEYS ? PART_KEYS : std::max<int64_t>(Tk, 1);
  const int64_t parts = std::max<int64_t>(1, (Tk + span - 1) / span);
  // a part's max, sum and weighted values per head, kept for the merge where there are several
  std::vector<float> part_max(parts > 1 ? pairs * parts * group : 0), part_sum(part_max.size()),
      part_acc(part_max.size() * D);
  // one thread unless there is work for more: chunks of (pair, part) items of at least 2^16 multiply-adds
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(pair_work / parts, 1));
  at::parallel_for(0, pairs * parts, grain, [&](int64_t a0, int64_t a1) {
    std::vector<float> scores(group * span), qf(group * D), acc(group * D), top(group), sum(group);
    std::vector<const T*> keys(span), vals(span);
    for (int64_t a = a0; a < a1; a++) {
      const int64_t pair = a / parts, part = a % parts, i = pair / Hkv, g = pair % Hkv;
      const int64_t t_begin = part * span, len = std::min(Tk, t_begin + span) - t_begin;
      const bool* m = mask ? mask + i * Tk + t_begin : nullptr;
      for (int64_t t = 0; t < len; t++) {
        keys[t] = kc + read[t_begin + t] * row + g * D;
        vals[t] = vc + read[t_begin + t] * row + g * D;
      }
      for (int64_t j = 0; j < group; j++)
        for (int64_t d = 0; d < D; d++) qf[j * D + d] = widen(q[(i * Hq + g * group + j) * D + d]) * scale;
      for (int64_t t0 = 0; t0 < len; t0 += KEY_BLOCK)
        for (int64_t j = 0; j < group; j++)
          dots(qf.data() + j * D, keys.data() + t0, scores.data() + j * span + t0, std::min(KEY_BLOCK, len - t0), D);
      for (int64_t j = 0; j < group; j++) sum[j] = softmax_numerators(scores.data() + j * span, m, len, &top[j]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += KEY_BLOCK)
        for (int64_t j = 0; j < group; j++)
          add_weighted(scores.data() + j * span + t0, vals.data() + t0, acc.data() + j * D, std::min(KEY_BLOCK, len - t0), D);
      if (parts == 1) {
        for (int64_t j = 0; j < group; j++) {
          O* o = out + (i * Hq + g * group + j) * D;
          const float inv = 1.f / sum[j];
          for (int64_t d = 0; d < D; d++) o[d] = O(acc[j * D + d] * inv);
        }
        continue;
      }
      std::copy(top.begin(), top.end(), part_max.begin() + a * group);
      std::copy(sum.begin(), sum.end(), part_sum.begin() + a * group);
      std::copy(acc.begin(), acc.end(), part_acc.begin() + a * group * D);
    }
  });
  if (parts == 1) return;
  std::vector<float> merged(D);
  for (int64_t pair = 0; pair < pairs; pair++)
    for (int64_t j = 0; j < group; j++) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t p = 0; p < parts; p++) top = std::max(top, part_max[(pair * parts + p) * group + j]);
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t p = 0; p < parts; p++) {
        const int64_t at = (pair * parts + p) * group + j;
        if (part_sum[at] == 0.f) continue;  // a part the row sees none of
        const float w = std::exp(part_max[at] - top);
        total += w * part_sum[at];
        for (int64_t d = 0; d < D; d++) merged[d] += w * part_acc[at * D + d];
      }
      const int64_t i = pair / Hkv, g = pair % Hkv;
      O* o = out + (i * Hq + g * group + j) * D;
      for (int64_t d = 0; d < D; d++) o[d] = O(merged[d] / total);
    }
}

// pages [S, row] at slots [n] = rows [n, row] (converted to the pages' type): a step's new keys or values
template <typename T, typename S>
inline void write_slots(T* pages, const S* rows, const int64_t* slots, int64_t n, int64_t row) {
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < row; j++) pages[slots[i] * row + j] = T(rows[i * row + j]);
}

// The checks every op over the pages makes before it writes anything: k_pages, v_pages [S, Hkv, D] contiguous
// of dtype dt, D a multiple of 8, write_slots [n] and read_slots [T] int64 inside the pages, mask [n, T] bool.
inline void check_pages(const char* op, const at::Tensor& k_pages, const at::Tensor& v_pages,
                        const at::Tensor& write_slots, const at::Tensor& read_slots,
                        const std::optional<at::Tensor>& mask, int64_t n, int64_t D, at::ScalarType dt) {
  TORCH_CHECK(k_pages.dim() == 3 && k_pages.sizes() == v_pages.sizes() && k_pages.size(2) == D, op,
              ": k_pages, v_pages [S, Hkv, D] with the head dimension ", D, ", got ", k_pages.sizes(), " and ",
              v_pages.sizes());
  TORCH_CHECK(k_pages.scalar_type() == dt && v_pages.scalar_type() == dt, op,
              ": every tensor float32, or every tensor bfloat16");
  TORCH_CHECK(D % 8 == 0, op, ": a head dimension that is a multiple of 8, got ", D);
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous(), op, ": contiguous pages");
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && read_slots.scalar_type() == at::kLong &&
                  write_slots.numel() == n, op, ": write_slots [n] and read_slots [T] int64");
  const int64_t Tk = read_slots.numel(), S = k_pages.size(0);
  if (mask.has_value())
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == n && mask->size(1) == Tk, op,
                ": mask [n, T] bool, got ", mask->sizes());
  const at::Tensor ws = write_slots.contiguous(), rs = read_slots.contiguous();
  const int64_t* w = ws.data_ptr<int64_t>();
  const int64_t* r = rs.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(w[i] >= 0 && w[i] < S, op, ": write slot ", w[i], " outside the pages");
  for (int64_t t = 0; t < Tk; t++) TORCH_CHECK(r[t] >= 0 && r[t] < S, op, ": read slot ", r[t], " outside the pages");
}

}  // namespace specdec_cpu
