// Elementwise math shared by the native CPU kernels.

#ifndef KVJAX_KERNELS_CPU_MATH_H_
#define KVJAX_KERNELS_CPU_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvjax {

// exp(x) for x <= 0, written so that loops over it vectorise (std::exp does
// not): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
// polynomial (relative error ~1e-7), 2^n assembled in the exponent bits.
// Below -87 the result would be subnormal; it is flushed to 0 (so is -inf).
inline float ExpNonPositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;  // ln2 split in two (Cody and Waite)
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// ExpNonPositive on 8 lanes, the same steps (compilers leave the scalar loop
// unvectorised: its flush to 0 becomes a branch).
inline __m256 ExpNonPositive8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

// The largest of row[0, n) and `floor`.
inline float RowMax(const float* row, int64_t n, float floor) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 top = _mm256_set1_ps(floor);
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float lane : lanes) floor = std::max(floor, lane);
#endif
  for (; j < n; ++j) floor = std::max(floor, row[j]);
  return floor;
}

// row[j] = exp(row[j] - top) for j < n (every row[j] <= top); returns their sum.
inline float ExpShiftedSum(float* row, int64_t n, float top) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
    _mm256_storeu_ps(row + j, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < n; ++j) {
    row[j] = ExpNonPositive(row[j] - top);
    sum += row[j];
  }
  return sum;
}

}  // namespace kvjax

#endif  // KVJAX_KERNELS_CPU_MATH_H_
