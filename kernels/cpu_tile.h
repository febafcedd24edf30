// The register tile of the native CPU kernels' matrix products.
//
// Tile<R>: C[R, 16] (+)= A[R, depth] B[depth, 16], R <= 6 rows of A broadcast
// one element at a time against two 8-lane rows of B: 12 accumulators, AVX2 +
// FMA where compiled for it, else loops the compiler vectorises. Product runs
// it over whole matrices whose B comes in 16-column panels.

#ifndef KVJAX_KERNELS_CPU_TILE_H_
#define KVJAX_KERNELS_CPU_TILE_H_

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVJAX_AVX2 1
#endif

namespace kvjax {

constexpr int64_t kTileRows = 6, kTileCols = 16;

// C[R, 16] (+)= A[R, depth] B[depth, 16]; A rows lda apart, B rows ldb apart,
// C rows ldc apart. R <= kTileRows.
template <int R>
inline void Tile(int64_t depth, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate) {
#ifdef KVJAX_AVX2
  __m256 lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = accumulate ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
    hi[i] = accumulate ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t d = 0; d < depth; ++d) {
    const __m256 b_lo = _mm256_loadu_ps(b + d * ldb), b_hi = _mm256_loadu_ps(b + d * ldb + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + d);
      lo[i] = _mm256_fmadd_ps(x, b_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, b_hi, hi[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(c + i * ldc, lo[i]);
    _mm256_storeu_ps(c + i * ldc + 8, hi[i]);
  }
#else
  float acc[R][kTileCols];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < kTileCols; ++j) acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
  }
  for (int64_t d = 0; d < depth; ++d) {
    for (int i = 0; i < R; ++i) {
      const float x = a[i * lda + d];
#pragma omp simd
      for (int j = 0; j < kTileCols; ++j) acc[i][j] += x * b[d * ldb + j];
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < kTileCols; ++j) c[i * ldc + j] = acc[i][j];
  }
#endif
}

// C[rows, cols] (+)= A[rows, depth] B[depth, cols], cols a multiple of 16.
inline void Product(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda,
             const float* b, int64_t ldb, int64_t b_panel, float* c, int64_t ldc,
             bool accumulate) {
  // b_panel: offset from one 16-column panel of B to the next.
  for (int64_t j = 0; j < cols; j += kTileCols) {
    const float* bj = b + (j / kTileCols) * b_panel;
    int64_t i = 0;
    for (; i + kTileRows <= rows; i += kTileRows) {
      Tile<kTileRows>(depth, a + i * lda, lda, bj, ldb, c + i * ldc + j, ldc, accumulate);
    }
    const float* ai = a + i * lda;
    float* ci = c + i * ldc + j;
    switch (rows - i) {
      case 5: Tile<5>(depth, ai, lda, bj, ldb, ci, ldc, accumulate); break;
      case 4: Tile<4>(depth, ai, lda, bj, ldb, ci, ldc, accumulate); break;
      case 3: Tile<3>(depth, ai, lda, bj, ldb, ci, ldc, accumulate); break;
      case 2: Tile<2>(depth, ai, lda, bj, ldb, ci, ldc, accumulate); break;
      case 1: Tile<1>(depth, ai, lda, bj, ldb, ci, ldc, accumulate); break;
      default: break;
    }
  }
}

}  // namespace kvjax

#endif  // KVJAX_KERNELS_CPU_TILE_H_
