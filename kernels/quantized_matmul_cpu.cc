// Block-quantized weights on CPU, XLA FFI custom calls: GGUF's Q4_1 and Q8_0
// blocks, read as stored.
//
// The same computations as kvjax.kernels.quantized's references, shapes as there:
//   x      [M, D_in]   float32 activations
//   w      [D_out, R]  uint8, each row D_in / 32 blocks of R / (D_in / 32) bytes
//   format            GGML's type id: 3 = Q4_1, 8 = Q8_0
//
//   kvjax_quantized_matmul_cpu:  out [M, D_out] = x @ dequantize(w).T, float32
//   kvjax_dequantize_cpu:        out [D_in, D_out] (transpose = 1) or [D_out, D_in]
//
// Block layouts (ggml's block_q4_1 and block_q8_0), 32 weights each:
//   Q4_1  f16 d, f16 m, 16 bytes of nibbles: w[j] = d * (q[j] & 15) + m and
//         w[j + 16] = d * (q[j] >> 4) + m for j < 16   (20 bytes)
//   Q8_0  f16 d, 32 int8 q: w[j] = d * q[j]             (34 bytes)
//
// Why it exists: a one-token decode step reads every weight once, and reading
// them as float32 moves 6.4x (Q4_1) or 3.8x (Q8_0) the bytes of the blocks.
// Up to kMatvecRows rows of x (decode steps), the product unpacks each block
// in registers and never writes the float weights: Q4_1 as
// d * sum(x q) + m * sum(x), each block's sum(x) computed once per call, a
// block's unpacked weights serving every row of x. More rows (a prompt) run a
// blocked GEMM on cpu_tile.h's register tile, whose packed panels of B are
// dequantized from the blocks as they are packed: the float weights exist
// only a panel (16 columns x kDepth inputs) at a time.
//
// The work is cut into parts that XLA's intra-op threads share.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_parallel.h"
#include "cpu_tile.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::kTileCols;
using kvjax::kTileRows;

constexpr int64_t kBlock = 32;
constexpr int32_t kQ4_1 = 3, kQ8_0 = 8;

int64_t BlockBytes(int32_t format) {
  return format == kQ4_1 ? 20 : format == kQ8_0 ? 34 : 0;
}

// IEEE half -> float, subnormals included (the scales of small weights are).
inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#ifdef __F16C__
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A block's 32 weights as integers in float32 (Q4_1's nibbles, Q8_0's bytes),
// before scaling: w = d * q (+ m for Q4_1).
inline void UnpackBlock(const uint8_t* block, int32_t format, float* q) {
  if (format == kQ4_1) {
    const uint8_t* nibbles = block + 4;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<float>(nibbles[j] & 15);
      q[j + 16] = static_cast<float>(nibbles[j] >> 4);
    }
  } else {
    const int8_t* bytes = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlock; ++j) q[j] = static_cast<float>(bytes[j]);
  }
}

// out[r * out_stride] for r < R rows of x (x_stride apart) and one row of w:
// sum over blocks of d * dot(x_block, q) (+ m * sum(x_block) for Q4_1, from
// x_sums [R, blocks]).
template <int32_t format, int R>
void RowTimesBlocks(const float* x, int64_t x_stride, const float* x_sums, const uint8_t* w_row,
                    int64_t blocks, float* out, int64_t out_stride) {
  constexpr int64_t bytes = format == kQ4_1 ? 20 : 34;
  float bias[R] = {};
#ifdef KVJAX_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w_row + b * bytes;
    __m256 q[4];
    if constexpr (format == kQ4_1) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
      const __m128i lo = _mm_and_si128(raw, low_nibbles);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low_nibbles);
      q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      }
    }
    const __m256 d = _mm256_set1_ps(HalfToFloat(block));
    const float m = format == kQ4_1 ? HalfToFloat(block + 2) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * x_stride + b * kBlock;
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);
      s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);
      s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);
      acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
      if constexpr (format == kQ4_1) bias[r] += m * x_sums[r * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    const float sum = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    out[r * out_stride] = sum + bias[r];
  }
#else
  float acc[R] = {};
  float q[kBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w_row + b * bytes;
    UnpackBlock(block, format, q);
    const float d = HalfToFloat(block);
    const float m = format == kQ4_1 ? HalfToFloat(block + 2) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * x_stride + b * kBlock;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < kBlock; ++j) s += q[j] * xb[j];
      acc[r] += d * s;
      if constexpr (format == kQ4_1) bias[r] += m * x_sums[r * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = acc[r] + bias[r];
#endif
}

// Rows of w per part: enough work to pay for a hand-off, and whole cache lines
// of the transposed dequantized output.
constexpr int64_t kRowsPerPart = 64;

// Rows [first, end) of w times every row of x.
template <int32_t format>
void RowsTimesX(const float* x, const float* sums, const uint8_t* w, int64_t m, int64_t d_in,
                int64_t d_out, int64_t first, int64_t end, float* out) {
  const int64_t blocks = d_in / kBlock, row_bytes = blocks * BlockBytes(format);
  for (int64_t o = first; o < end; ++o) {
    const uint8_t* row = w + o * row_bytes;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
      RowTimesBlocks<format, 4>(x + r * d_in, d_in, sums + r * blocks, row, blocks,
                                out + r * d_out + o, d_out);
    }
    for (; r < m; ++r) {
      RowTimesBlocks<format, 1>(x + r * d_in, d_in, sums + r * blocks, row, blocks,
                                out + r * d_out + o, d_out);
    }
  }
}

// Rows of x up to which the product reads the blocks in place; more run the GEMM.
constexpr int64_t kMatvecRows = 16;
// The GEMM's blocking: a part is kGemmRows rows of x by kGemmCols columns of
// out; each pass over kDepth inputs packs the part's panels (8 x 36 KB, L2)
// and runs the tile over x's rows.
constexpr int64_t kGemmRows = 240, kGemmCols = 128, kDepth = 576;

// panel [depth, 16] = dequantized w rows o0 .. o0 + cols - 1 (zeros after), inputs
// [k0, k0 + depth); k0 and depth are multiples of 32.
void PackPanel(const uint8_t* w, int64_t row_bytes, int32_t format, int64_t o0, int64_t cols,
               int64_t k0, int64_t depth, float* panel) {
  const int64_t bytes = BlockBytes(format);
  float q[kBlock];
  for (int64_t j = 0; j < kTileCols; ++j) {
    if (j >= cols) {
      for (int64_t d = 0; d < depth; ++d) panel[d * kTileCols + j] = 0.0f;
      continue;
    }
    const uint8_t* row = w + (o0 + j) * row_bytes;
    for (int64_t b = k0 / kBlock; b < (k0 + depth) / kBlock; ++b) {
      const uint8_t* block = row + b * bytes;
      UnpackBlock(block, format, q);
      const float d = HalfToFloat(block);
      const float m = format == kQ4_1 ? HalfToFloat(block + 2) : 0.0f;
      float* dst = panel + (b * kBlock - k0) * kTileCols + j;
      for (int64_t i = 0; i < kBlock; ++i) dst[i * kTileCols] = d * q[i] + m;
    }
  }
}

// out [m, d_out] = x [m, d_in] @ dequantize(w).T, blocked.
template <typename Schedule>
void Gemm(const float* x, const uint8_t* w, int64_t m, int64_t d_in, int64_t d_out,
          int32_t format, float* out, int64_t threads, Schedule&& schedule) {
  const int64_t row_bytes = d_in / kBlock * BlockBytes(format);
  const int64_t row_parts = (m + kGemmRows - 1) / kGemmRows;
  const int64_t col_parts = (d_out + kGemmCols - 1) / kGemmCols;
  kvjax::RunParts(row_parts * col_parts, threads, schedule, [=](int64_t p) {
    thread_local std::vector<float> panels;
    panels.resize(kGemmCols * kDepth);
    const int64_t r0 = (p / col_parts) * kGemmRows, rows = std::min(kGemmRows, m - r0);
    const int64_t c0 = (p % col_parts) * kGemmCols, cols = std::min(kGemmCols, d_out - c0);
    const int64_t whole = cols / kTileCols * kTileCols;  // columns in whole panels
    float tail[kTileRows * kTileCols];
    for (int64_t k0 = 0; k0 < d_in; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, d_in - k0);
      for (int64_t c = 0; c < cols; c += kTileCols) {
        PackPanel(w, row_bytes, format, c0 + c, std::min(kTileCols, cols - c), k0, depth,
                  panels.data() + c * kDepth);
      }
      const float* a = x + r0 * d_in + k0;
      float* o = out + r0 * d_out + c0;
      kvjax::Product(rows, whole, depth, a, d_in, panels.data(), kTileCols,
                     kTileCols * kDepth, o, d_out, k0 > 0);
      if (whole == cols) continue;
      // The last, partial panel: through a full tile, its valid columns copied.
      const float* panel = panels.data() + whole * kDepth;
      for (int64_t r = 0; r < rows; r += kTileRows) {
        const int64_t n = std::min(kTileRows, rows - r);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; j < kTileCols; ++j) {
            tail[i * kTileCols + j] =
                k0 > 0 && whole + j < cols ? o[(r + i) * d_out + whole + j] : 0.0f;
          }
        }
        kvjax::Product(n, kTileCols, depth, a + r * d_in, d_in, panel, kTileCols, 0, tail,
                       kTileCols, true);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; whole + j < cols; ++j) {
            o[(r + i) * d_out + whole + j] = tail[i * kTileCols + j];
          }
        }
      }
    }
  });
}

template <typename Schedule>
void QuantizedMatmul(const float* x, const uint8_t* w, int64_t m, int64_t d_in, int64_t d_out,
                     int32_t format, float* out, int64_t threads, Schedule&& schedule) {
  if (m > kMatvecRows) {
    Gemm(x, w, m, d_in, d_out, format, out, threads, schedule);
    return;
  }
  const int64_t blocks = d_in / kBlock;
  std::vector<float> x_sums(static_cast<size_t>(m * blocks), 0.0f);
  if (format == kQ4_1) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) s += x[r * d_in + b * kBlock + j];
        x_sums[r * blocks + b] = s;
      }
    }
  }
  const float* sums = x_sums.data();
  const int64_t parts = (d_out + kRowsPerPart - 1) / kRowsPerPart;
  kvjax::RunParts(parts, threads, schedule, [=](int64_t p) {
    const int64_t first = p * kRowsPerPart, end = std::min(d_out, first + kRowsPerPart);
    if (format == kQ4_1) {
      RowsTimesX<kQ4_1>(x, sums, w, m, d_in, d_out, first, end, out);
    } else {
      RowsTimesX<kQ8_0>(x, sums, w, m, d_in, d_out, first, end, out);
    }
  });
}

template <typename Schedule>
void Dequantize(const uint8_t* w, int64_t d_in, int64_t d_out, int32_t format, bool transpose,
                float* out, int64_t threads, Schedule&& schedule) {
  const int64_t blocks = d_in / kBlock, bytes = BlockBytes(format), row_bytes = blocks * bytes;
  const int64_t parts = (d_out + kRowsPerPart - 1) / kRowsPerPart;
  kvjax::RunParts(parts, threads, schedule, [=](int64_t p) {
    const int64_t first = p * kRowsPerPart, end = std::min(d_out, first + kRowsPerPart);
    float q[kBlock];
    std::vector<float> tile(transpose ? static_cast<size_t>(kRowsPerPart * kBlock) : 0);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t o = first; o < end; ++o) {
        const uint8_t* block = w + o * row_bytes + b * bytes;
        UnpackBlock(block, format, q);
        const float d = HalfToFloat(block);
        const float m = format == kQ4_1 ? HalfToFloat(block + 2) : 0.0f;
        float* dst = transpose ? tile.data() + (o - first) * kBlock : out + o * d_in + b * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) dst[j] = d * q[j] + m;
      }
      if (transpose) {  // tile [rows, 32] -> out[b * 32 + j, first:end]
        for (int64_t j = 0; j < kBlock; ++j) {
          float* dst = out + (b * kBlock + j) * d_out + first;
          for (int64_t o = 0; o < end - first; ++o) dst[o] = tile[o * kBlock + j];
        }
      }
    }
  });
}

std::string DimsText(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// "" when w [D_out, R] holds whole blocks of `format` for D_in inputs.
std::string CheckWeights(const char* name, ffi::Span<const int64_t> wd, int64_t d_in,
                         int32_t format) {
  const int64_t bytes = BlockBytes(format);
  if (bytes == 0) return std::string(name) + ": unknown format " + std::to_string(format);
  if (wd.size() != 2 || d_in <= 0 || d_in % kBlock != 0 || wd[1] != d_in / kBlock * bytes) {
    return std::string(name) + ": weights " + DimsText(wd) + " are not [D_out, D_in / 32 * " +
           std::to_string(bytes) + "] for D_in = " + std::to_string(d_in);
  }
  return "";
}

ffi::Error QuantizedMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                              ffi::ResultBuffer<ffi::F32> out, int32_t format,
                              ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  std::string error = xd.size() != 2 ? "kvjax_quantized_matmul_cpu: x " + DimsText(xd) + " is not [M, D_in]"
                                     : CheckWeights("kvjax_quantized_matmul_cpu", wd, xd[1], format);
  if (error.empty() && (od.size() != 2 || od[0] != xd[0] || od[1] != wd[0])) {
    error = "kvjax_quantized_matmul_cpu: out " + DimsText(od) + " is not [M, D_out]";
  }
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  QuantizedMatmul(x.typed_data(), w.typed_data(), xd[0], xd[1], wd[0], format,
                  out->typed_data(), std::max<int64_t>(1, pool.num_threads()),
                  [&pool](auto task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

ffi::Error DequantizeCpu(ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> out, int32_t format,
                         int32_t transpose, ffi::ThreadPool pool) {
  const auto wd = w.dimensions(), od = out->dimensions();
  const int64_t d_in = od.size() == 2 ? od[transpose ? 0 : 1] : 0;
  std::string error = CheckWeights("kvjax_dequantize_cpu", wd, d_in, format);
  if (error.empty() && od[transpose ? 1 : 0] != wd[0]) {
    error = "kvjax_dequantize_cpu: out " + DimsText(od) + " does not match weights " + DimsText(wd);
  }
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  Dequantize(w.typed_data(), d_in, wd[0], format, transpose != 0, out->typed_data(),
             std::max<int64_t>(1, pool.num_threads()),
             [&pool](auto task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxQuantizedMatmulCpu, QuantizedMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("format")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDequantizeCpu, DequantizeCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("transpose")
                                  .Ctx<ffi::ThreadPool>());
