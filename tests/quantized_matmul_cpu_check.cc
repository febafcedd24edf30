// Memory-safety and thread check of kernels/quantized_matmul_cpu.cc, run by tests/native_cpu_check.cc.
//
// Random shapes (rows of x, D_in, D_out, both formats), every buffer its own
// heap allocation of exactly its size, 1-4 threads; the product and both
// dequantized layouts are checked against a direct per-weight loop. Prints
// "<n> cases" when all pass.

#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "quantized_matmul_cpu.cc"

namespace {

// The weight at (row o, input i) straight from the block layout.
float Weight(const std::vector<uint8_t>& w, int32_t format, int64_t d_in, int64_t o, int64_t i) {
  const int64_t bytes = BlockBytes(format);
  const uint8_t* block = w.data() + o * (d_in / 32) * bytes + (i / 32) * bytes;
  const int j = i % 32;
  const float d = HalfToFloat(block);
  if (format == kQ4_1) {
    const uint8_t byte = block[4 + j % 16];
    return d * static_cast<float>(j < 16 ? byte & 15 : byte >> 4) + HalfToFloat(block + 2);
  }
  return d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
}

}  // namespace

int CheckQuantizedMatmul() {
  std::mt19937 rng(0);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::normal_distribution<float> normal;
  const int kCases = 200;
  for (int c = 0; c < kCases; ++c) {
    const int32_t format = uniform(0, 1) ? kQ4_1 : kQ8_0;
    const int64_t m = uniform(1, 20), d_in = 32 * uniform(1, 8), d_out = uniform(1, 200);
    std::vector<uint8_t> w(d_out * (d_in / 32) * BlockBytes(format));
    for (uint8_t& b : w) b = static_cast<uint8_t>(uniform(0, 255));
    for (int64_t o = 0; o < d_out; ++o) {  // finite scales: exponents 1..20 of 31
      for (int64_t b = 0; b < d_in / 32; ++b) {
        uint8_t* block = w.data() + (o * (d_in / 32) + b) * BlockBytes(format);
        for (int s = 0; s < (format == kQ4_1 ? 2 : 1); ++s) {
          const uint16_t half = static_cast<uint16_t>((uniform(0, 1) << 15) |
                                                      (uniform(1, 20) << 10) | uniform(0, 1023));
          std::memcpy(block + 2 * s, &half, sizeof(half));
        }
      }
    }
    std::vector<float> x(m * d_in), out(m * d_out, NAN), plain(d_out * d_in, NAN),
        transposed(d_in * d_out, NAN);
    for (float& f : x) f = normal(rng);
    const int threads = uniform(1, 4);
    std::vector<std::thread> helpers;
    auto schedule = [&](auto task) { helpers.emplace_back(std::move(task)); };
    QuantizedMatmul(x.data(), w.data(), m, d_in, d_out, format, out.data(), threads, schedule);
    Dequantize(w.data(), d_in, d_out, format, false, plain.data(), threads, schedule);
    Dequantize(w.data(), d_in, d_out, format, true, transposed.data(), threads, schedule);
    for (auto& helper : helpers) helper.join();
    for (int64_t o = 0; o < d_out; ++o) {
      for (int64_t i = 0; i < d_in; ++i) {
        const float want = Weight(w, format, d_in, o, i);
        if (plain[o * d_in + i] != want || transposed[i * d_out + o] != want) {
          std::printf("case %d: dequantized weight (%ld, %ld) differs\n", c, o, i);
          return 1;
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        double want = 0.0, scale = 0.0;
        for (int64_t i = 0; i < d_in; ++i) {
          const double term = static_cast<double>(x[r * d_in + i]) * Weight(w, format, d_in, o, i);
          want += term;
          scale += std::fabs(term);
        }
        if (!(std::fabs(out[r * d_out + o] - want) <= 1e-5 * scale + 1e-30)) {
          std::printf("case %d: out (%ld, %ld) = %g, want %g\n", c, r, o, out[r * d_out + o], want);
          return 1;
        }
      }
    }
  }
  std::printf("quantized matmul: %d cases\n", kCases);
  return 0;
}
