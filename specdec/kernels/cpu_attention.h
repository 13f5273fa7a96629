// One layer's attention over the paged KV as templates, for cpu_attention.cpp's op and cpu_layer.cpp's decoder
// layer: every query row's heads over the slots it reads, a few rows' heads of a KV group against each key row.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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

// Q query vectors (q [Q, D], float32) against the keys at k[t], t < Tk (D % 8 == 0): scores [Q, stride]
// get scores[j * stride + t] = q_j . k_t. Every score is 8 lanes of multiply-adds over D, summed by hsum8's tree
// (hsum for the last Tk % 8 keys): eight keys of one query, or four keys of two queries, a tile, so a key row read
// once serves two queries and every score's arithmetic is the same in either tile.
template <typename T>
void dots(const float* q, int64_t Q, const T* const* k, float* scores, int64_t stride, int64_t Tk, int64_t D) {
  const int64_t full = Tk / 8 * 8;
  int64_t j = 0;
  for (; j + 2 <= Q; j += 2)  // two queries, four keys a tile
    for (int64_t t = 0; t < full; t += 4) {
      __m256 acc[8];
      for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 q0 = _mm256_loadu_ps(q + j * D + d), q1 = _mm256_loadu_ps(q + (j + 1) * D + d);
        for (int c = 0; c < 4; c++) {
          const __m256 kv = load8(k[t + c] + d);
          acc[c] = _mm256_fmadd_ps(q0, kv, acc[c]);
          acc[4 + c] = _mm256_fmadd_ps(q1, kv, acc[4 + c]);
        }
      }
      const __m256 sums = hsum8(acc);
      _mm_storeu_ps(scores + j * stride + t, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(scores + (j + 1) * stride + t, _mm256_extractf128_ps(sums, 1));
    }
  for (; j < Q; j++)  // one query, eight keys a tile
    for (int64_t t = 0; t < full; t += 8) {
      __m256 acc[8];
      for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j * D + d);
        for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(qv, load8(k[t + c] + d), acc[c]);
      }
      _mm256_storeu_ps(scores + j * stride + t, hsum8(acc));
    }
  for (j = 0; j < Q; j++)
    for (int64_t t = full; t < Tk; t++) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), load8(k[t] + d), acc);
      scores[j * stride + t] = hsum(acc);
    }
}

// acc[j, c0 .. c0 + 8 C) += sum_t p[j * stride + t] v_t[off + c0 ..) for QB queries j, t < Tk in order, held in
// QB x C registers: each value row read once for QB queries
template <int QB, int C, typename T>
void weighted_tile(const float* p, int64_t stride, const T* const* v, int64_t off, float* acc, int64_t D, int64_t Tk) {
  __m256 a[QB][C];
  for (int j = 0; j < QB; j++)
    for (int c = 0; c < C; c++) a[j][c] = _mm256_loadu_ps(acc + j * D + 8 * c);
  for (int64_t t = 0; t < Tk; t++) {
    __m256 vv[C];
    for (int c = 0; c < C; c++) vv[c] = load8(v[t] + off + 8 * c);
    for (int j = 0; j < QB; j++) {
      const __m256 pv = _mm256_set1_ps(p[j * stride + t]);
      for (int c = 0; c < C; c++) a[j][c] = _mm256_fmadd_ps(pv, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < QB; j++)
    for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + j * D + 8 * c, a[j][c]);
}

// weighted_tile over lanes [0, D) for QB queries: C register columns (8 lanes each) at a time, then the lanes
// left one column at a time
template <int QB, int C, typename T>
void weighted_lanes(const float* p, int64_t stride, const T* const* v, float* acc, int64_t D,
                    int64_t Tk) {
  int64_t d = 0;
  for (; d + 8 * C <= D; d += 8 * C) weighted_tile<QB, C>(p, stride, v, d, acc + d, D, Tk);
  for (; d < D; d += 8) weighted_tile<QB, 1>(p, stride, v, d, acc + d, D, Tk);
}

// acc [Q, D] += p [Q, stride] (first Tk columns) @ the value rows v[t] [Tk, D] (D % 8 == 0): per query
// and lane a sum over t in order. Tiles of 8 accumulators (4 queries x 16 lanes, 2 x 32, 1 x 64): each
// accumulator's chain of multiply-adds waits on itself once a key, so 8 of them keep both FMA units busy.
template <typename T>
void add_weighted(const float* p, int64_t Q, int64_t stride, const T* const* v, float* acc,
                  int64_t Tk, int64_t D) {
  int64_t j = 0;
  for (; j + 4 <= Q; j += 4) weighted_lanes<4, 2>(p + j * stride, stride, v, acc + j * D, D, Tk);
  for (; j + 2 <= Q; j += 2) weighted_lanes<2, 4>(p + j * stride, stride, v, acc + j * D, D, Tk);
  for (; j < Q; j++) weighted_lanes<1, 8>(p + j * stride, stride, v, acc + j * D, D, Tk);
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

// asks for the cache lines of a slot's row [count] (Hint: _MM_HINT_T0 to L1, _MM_HINT_T1 to L2)
template <decltype(_MM_HINT_T0) Hint, typename T>  // (an enum in GCC, an int in Clang)
inline void prefetch_row(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * int64_t(sizeof(T)); b += 64) _mm_prefetch(c + b, Hint);
}

// rows[0 .. count) of `row` values (row % 8 == 0) as float32 rows: float32 pages' rows as they are; bfloat16
// ones widened once into buf (count x row), so that each of the heads reading them does no conversion of its own
template <typename T>
inline const float* const* float_rows(const T* const* rows, int64_t count, int64_t row, std::vector<float>& buf,
                                      std::vector<const float*>& ptrs) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    for (int64_t t = 0; t < count; t++) {
      float* dst = buf.data() + t * row;
      for (int64_t j = 0; j < row; j += 8) _mm256_storeu_ps(dst + j, load8(rows[t] + j));
      ptrs[t] = dst;
    }
    return ptrs.data();
  }
}

constexpr int64_t KEY_BLOCK = 32;  // keys read from the pages once per block, then from L1 by every query
constexpr int64_t PART_KEYS = 256;  // the most keys a part where few items would share the keys out
constexpr int64_t ITEM_ROWS = 4;    // the most query rows an item (the rows shared out evenly between items)
constexpr int64_t MIN_ITEMS = 8;    // fewer row items than this: the keys split into parts too

// How many keys a part holds, for `items` row items over Tk keys: every key where the items are enough to share
// out (MIN_ITEMS) or the keys too few to split (under 2 * KEY_BLOCK); else the keys in MIN_ITEMS / items parts
// (whole blocks), at most PART_KEYS a part. Set by the shapes alone, so the numbers do not change with the
// thread count.
inline int64_t part_span(int64_t items, int64_t Tk) {
  if (items >= MIN_ITEMS || Tk < 2 * KEY_BLOCK) return std::max<int64_t>(Tk, 1);
  const int64_t parts = (MIN_ITEMS + items - 1) / items;
  const int64_t span = ((Tk + parts - 1) / parts + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  return std::min(span, PART_KEYS);
}

// Every (up to ITEM_ROWS query rows, part of the keys) item: all the rows' heads attend over the part's keys
// block by block. A block's key rows ([Hkv, D] a slot, contiguous in the pages) are asked for a block ahead and
// its value rows while its keys are used (the pages come from memory after a step's weights have streamed
// through the caches), then each KV group's slice of them, widened once where bfloat16, serves every head of
// every row that reads it (dots, add_weighted). Where the items are few (a decode step), the keys are split into
// parts attended in parallel, each part with its own max, sum and weighted values per head, merged after
// (flash-decoding). A head's arithmetic is the same whichever item holds it.
template <typename T, typename Q, typename O>
void attend_all(const Q* q, const T* kc, const T* vc, const int64_t* read, const bool* mask, float scale, O* out,
                int64_t n, int64_t Hq, int64_t Hkv, int64_t D, int64_t Tk) {
  const int64_t group = Hq / Hkv, row = Hkv * D;  // row: a slot's stride in the pages
  const int64_t chunks = (n + ITEM_ROWS - 1) / ITEM_ROWS;
  const int64_t span = part_span(chunks, Tk), parts = std::max<int64_t>(1, (Tk + span - 1) / span);
  // a part's max, sum and weighted values per (row, head), kept for the merge where there are several
  std::vector<float> part_max(parts > 1 ? parts * n * Hq : 0), part_sum(part_max.size()),
      part_acc(part_max.size() * D);
  // one thread unless there is work for more: chunks of items of at least 2^16 multiply-adds
  const int64_t item_work = std::max<int64_t>(span * D * 2 * std::min(n, ITEM_ROWS) * Hq, 1);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / item_work);
  at::parallel_for(0, chunks * parts, grain, [&](int64_t a0, int64_t a1) {
    const int64_t most = ITEM_ROWS * Hq;  // query vectors an item, group g's (rows x group) together
    std::vector<float> scores(most * span), qf(most * D), acc(most * D), top(most), sum(most);
    std::vector<const T*> keys(span), vals(span), slice(KEY_BLOCK);
    std::vector<float> block(std::is_same_v<T, float> ? 0 : KEY_BLOCK * D);  // a group's slice widened
    std::vector<const float*> block_rows(KEY_BLOCK);
    for (int64_t a = a0; a < a1; a++) {
      const int64_t part = a % parts, chunk = a / parts;
      const int64_t i0 = chunk * n / chunks, rows = (chunk + 1) * n / chunks - i0;
      const int64_t t_begin = part * span, len = std::min(Tk, t_begin + span) - t_begin, per_group = rows * group;
      // query vector (g * rows + r) * group + j: row i0 + r's head g * group + j
      auto head = [&](int64_t v) {
        const int64_t g = v / per_group, r = v % per_group / group, j = v % group;
        return (i0 + r) * Hq + g * group + j;
      };
      for (int64_t t = 0; t < len; t++) {
        keys[t] = kc + read[t_begin + t] * row;
        vals[t] = vc + read[t_begin + t] * row;
      }
      for (int64_t v = 0; v < rows * Hq; v++)
        for (int64_t d = 0; d < D; d++) qf[v * D + d] = widen(q[head(v) * D + d]) * scale;
      for (int64_t t = 0; t < std::min(len, KEY_BLOCK); t++) prefetch_row<_MM_HINT_T0>(keys[t], row);
      for (int64_t t0 = 0; t0 < len; t0 += KEY_BLOCK) {
        const int64_t count = std::min(KEY_BLOCK, len - t0);
        for (int64_t t = t0 + KEY_BLOCK; t < std::min(len, t0 + 2 * KEY_BLOCK); t++)
          prefetch_row<_MM_HINT_T0>(keys[t], row);
        for (int64_t t = t0; t < t0 + count; t++) prefetch_row<_MM_HINT_T1>(vals[t], row);
        for (int64_t g = 0; g < Hkv; g++) {
          for (int64_t t = 0; t < count; t++) slice[t] = keys[t0 + t] + g * D;
          const float* const* k = float_rows(slice.data(), count, D, block, block_rows);
          dots(qf.data() + g * per_group * D, per_group, k, scores.data() + g * per_group * span + t0, span, count, D);
        }
      }
      for (int64_t v = 0; v < rows * Hq; v++) {
        const int64_t r = v % per_group / group;
        sum[v] = softmax_numerators(scores.data() + v * span, mask ? mask + (i0 + r) * Tk + t_begin : nullptr, len,
                                    &top[v]);
      }
      std::fill(acc.begin(), acc.begin() + rows * Hq * D, 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += KEY_BLOCK) {
        const int64_t count = std::min(KEY_BLOCK, len - t0);
        for (int64_t g = 0; g < Hkv; g++) {
          for (int64_t t = 0; t < count; t++) slice[t] = vals[t0 + t] + g * D;
          const float* const* v = float_rows(slice.data(), count, D, block, block_rows);
          add_weighted(scores.data() + g * per_group * span + t0, per_group, span, v, acc.data() + g * per_group * D,
                       count, D);
        }
      }
      for (int64_t v = 0; v < rows * Hq; v++) {
        const int64_t h = head(v);
        if (parts == 1) {
          O* o = out + h * D;
          const float inv = 1.f / sum[v];
          for (int64_t d = 0; d < D; d++) o[d] = O(acc[v * D + d] * inv);
        } else {
          part_max[h * parts + part] = top[v];
          part_sum[h * parts + part] = sum[v];
          std::copy_n(acc.begin() + v * D, D, part_acc.begin() + (h * parts + part) * D);
        }
      }
    }
  });
  if (parts == 1) return;
  std::vector<float> merged(D);
  for (int64_t h = 0; h < n * Hq; h++) {  // h: row i's head (i * Hq + head)
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < parts; p++) top = std::max(top, part_max[h * parts + p]);
    std::fill(merged.begin(), merged.end(), 0.f);
    for (int64_t p = 0; p < parts; p++) {
      const int64_t at = h * parts + p;
      if (part_sum[at] == 0.f) continue;  // a part the row sees none of
      const float w = std::exp(part_max[at] - top);
      total += w * part_sum[at];
      for (int64_t d = 0; d < D; d++) merged[d] += w * part_acc[at * D + d];
    }
    O* o = out + h * D;
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
