// Memory-safety and thread check of kernels/paged_attention_cpu.cc, run by tests/native_cpu_check.cc.
//
// Random shapes, page ids out of [0, P) and lengths out of [0, P_max * S_page);
// every buffer is its own heap allocation of exactly its size, so a read or
// write past any of them stops the run with a report. Outputs must be finite
// (the inputs are). Prints "<n> cases" when all pass.

#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "paged_attention_cpu.cc"

int CheckPagedAttention() {
  std::mt19937 rng(0);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::normal_distribution<float> normal;
  const int kCases = 300;
  for (int c = 0; c < kCases; ++c) {
    const int b = uniform(1, 3), kv = uniform(1, 3), g = uniform(1, 8), h = uniform(1, 70);
    const int page = uniform(1, 17), pool = uniform(1, 60), max_pages = uniform(1, 40);
    std::vector<float> q(b * kv * g * h), k(pool * page * h), v(pool * page * h);
    for (auto* x : {&q, &k, &v}) {
      for (float& f : *x) f = normal(rng);
    }
    std::vector<int32_t> table(b * kv * max_pages), lengths(b * kv);
    for (int32_t& id : table) id = uniform(-2, pool + 2);
    for (int32_t& n : lengths) n = uniform(-3, max_pages * page + 5);
    std::vector<float> out(b * kv * g * h, NAN);
    // Helpers on threads of their own, started when scheduled and joined after
    // the call: some claim parts, some start after the caller has taken them all.
    std::vector<std::thread> helpers;
    const int threads = uniform(1, 4);
    PagedAttention(q.data(), k.data(), v.data(), table.data(), lengths.data(), b, kv, g, h, pool,
                   page, max_pages, out.data(), threads,
                   [&](auto task) { helpers.emplace_back(std::move(task)); });
    for (auto& helper : helpers) helper.join();
    for (float f : out) {
      if (!std::isfinite(f)) {
        std::printf("case %d: non-finite output\n", c);
        return 1;
      }
    }
  }
  std::printf("paged attention: %d cases\n", kCases);
  return 0;
}
