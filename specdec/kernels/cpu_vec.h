// The AVX2 helpers specdec's CPU kernels share (cpu_rows.cpp, cpu_attention.cpp, cpu_layer.cpp): eight float32
// lanes loaded from float32 or bfloat16 (bfloat16 is float32's top half: widened by a shift) or rounded to
// bfloat16's precision, a register's lane sum, an op's body run for its dtype, and a row count's template.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace specdec_cpu {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // 8 bfloat16 -> 8 float32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// 8 float32 lanes rounded to bfloat16 and back: c10::BFloat16's round to nearest even (NaN to its quiet NaN)
inline __m256 round_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
// v rounded to T's precision, kept in float32 (identity for float)
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_bf16(v);
}
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// f(std::integral_constant<int, M>()) for a run-time M of 1 to Max (Max <= 8): the row kernels' dispatch to
// their templates for M rows of x (cpu_rows.h's AVX2 path up to 6, cpu_rows_bf16.h's up to 8)
template <int Max, typename F>
inline void with_row_count(int64_t M, F&& f) {
  static_assert(1 <= Max && Max <= 8, "templates for 1 to 8 rows of x");
  auto run = [&](auto m) {
    if constexpr (decltype(m)::value <= Max) f(m);
  };
  TORCH_CHECK(1 <= M && M <= Max, "row kernel: 1 to ", Max, " rows of x a call (product_segments chunks more), got ",
              M);
  switch (M) {
    case 1: return run(std::integral_constant<int, 1>());
    case 2: return run(std::integral_constant<int, 2>());
    case 3: return run(std::integral_constant<int, 3>());
    case 4: return run(std::integral_constant<int, 4>());
    case 5: return run(std::integral_constant<int, 5>());
    case 6: return run(std::integral_constant<int, 6>());
    case 7: return run(std::integral_constant<int, 7>());
    default: return run(std::integral_constant<int, 8>());
  }
}

// f(float()) or f(c10::BFloat16()) for dt (an op checked it is one of the two): the op's body, typed
template <typename F>
inline void with_float_type(c10::ScalarType dt, F&& f) {
  if (dt == c10::ScalarType::Float)
    f(float(0));
  else
    f(c10::BFloat16(0));
}

}  // namespace specdec_cpu
