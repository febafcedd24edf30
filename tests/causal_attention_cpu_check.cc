// Memory-safety and thread check of kernels/causal_attention_cpu.cc, run by tests/native_cpu_check.cc.
//
// Random shapes (head dims that are not a multiple of 16, prompts shorter and
// longer than a block), every buffer its own heap allocation of exactly its
// size, 1-4 threads; each output is checked against a float64 softmax. Prints
// "<n> cases" when all pass.

#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "causal_attention_cpu.cc"

int CheckCausalAttention() {
  std::mt19937 rng(0);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::normal_distribution<float> normal;
  const int kCases = 60;
  for (int c = 0; c < kCases; ++c) {
    const int64_t b = uniform(1, 2), kv = uniform(1, 3), g = uniform(1, 5);
    const int64_t t = uniform(1, 300), h = uniform(1, 40);
    const Shape4 s{b, t, kv * g, kv, h};
    std::vector<float> q(b * t * s.n * h), k(b * t * kv * h), v(b * t * kv * h),
        out(b * t * s.n * h, NAN);
    for (auto* x : {&q, &k, &v}) {
      for (float& f : *x) f = normal(rng);
    }
    std::vector<std::thread> helpers;
    CausalAttention(q.data(), k.data(), v.data(), out.data(), s, uniform(1, 4),
                    [&](auto task) { helpers.emplace_back(std::move(task)); });
    for (auto& helper : helpers) helper.join();
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t ti = 0; ti < t; ++ti) {
        for (int64_t n = 0; n < s.n; ++n) {
          const float* qr = &q[((bi * t + ti) * s.n + n) * h];
          std::vector<double> w(ti + 1);
          double top = -INFINITY, sum = 0.0;
          for (int64_t j = 0; j <= ti; ++j) {
            const float* kr = &k[((bi * t + j) * kv + n / g) * h];
            double dot = 0.0;
            for (int64_t d = 0; d < h; ++d) dot += double(qr[d]) * kr[d];
            w[j] = dot / std::sqrt(double(h));
            top = std::max(top, w[j]);
          }
          for (double& x : w) sum += (x = std::exp(x - top));
          for (int64_t d = 0; d < h; ++d) {
            double want = 0.0;
            for (int64_t j = 0; j <= ti; ++j) want += w[j] * v[((bi * t + j) * kv + n / g) * h + d];
            want /= sum;
            const float got = out[((bi * t + ti) * s.n + n) * h + d];
            if (!(std::fabs(got - want) <= 1e-4 * (1 + std::fabs(want)))) {
              std::printf("case %d: out (%ld, %ld, %ld, %ld) = %g, want %g\n", c, bi, ti, n, d,
                          got, want);
              return 1;
            }
          }
        }
      }
    }
  }
  std::printf("causal attention: %d cases\n", kCases);
  return 0;
}
