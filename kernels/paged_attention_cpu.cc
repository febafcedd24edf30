// Paged decode attention on CPU, an XLA FFI custom call.
//
// The same computation as kvjax.kernels.paged_attention.paged_attention_reference
// (without the weights), shapes as there:
//   q           [B, N, H]      float32
//   k_pages     [P, S_page, H] float32
//   v_pages     [P, S_page, H] float32
//   page_table  [B, K, P_max]  int32, page ids (< 0: absent, reads page 0)
//   lengths     [B, K]         int32, filled slots of each (sequence, KV head)
//   out         [B, N, H]      float32
//
// Why it exists: XLA's version gathers every page of a head into a contiguous
// copy, then runs four passes (logits, max, exp, values) over it. Here each
// (sequence, KV head) reads its pages in place, keys once and values once,
// and serves its G query heads from that one read; the logits of one head
// (G x length floats) stay in a per-thread buffer.
//
// Only slots below the length are read, so stale or non-finite data past it
// (or in pages a head does not own) never reaches the output. Page ids are
// clamped into [0, P) as XLA's gather clamps them. A head of length 0 gives
// zeros. Single-threaded: the decode step has other work for XLA's threads,
// and a threaded version measured no faster on two cores.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0, written so that loops over it vectorise (std::exp does
// not): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
// polynomial (relative error ~1e-7), 2^n assembled in the exponent bits.
// Below -87 the result would be subnormal; it is flushed to 0.
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

inline float Dot(const float* a, const float* b, int64_t h) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += a[i] * b[i];
  return sum;
}

// One (sequence, KV head): its G query rows q [G, H] -> out [G, H].
void AttendHead(const float* q, const float* k_pages, const float* v_pages,
                const int32_t* pages, int64_t num_pages, int64_t page_size,
                int64_t length, int64_t g, int64_t h, float* out) {
  if (length == 0) {
    std::fill(out, out + g * h, 0.0f);
    return;
  }
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(g * (h + length + 1)));
  float* scaled_q = scratch.data();       // [G, H]
  float* inv_sum = scaled_q + g * h;      // [G]
  float* logits = inv_sum + g;            // [G, length], then the weights
  const float scale = 1.0f / std::sqrt(static_cast<float>(h));
  for (int64_t i = 0; i < g * h; ++i) scaled_q[i] = q[i] * scale;

  const int64_t used_pages = (length + page_size - 1) / page_size;
  auto page_base = [&](const float* pool, int64_t j) {
    const int64_t id = std::clamp<int64_t>(pages[j], 0, num_pages - 1);
    return pool + id * page_size * h;
  };
  auto slots_in = [&](int64_t j) { return std::min(page_size, length - j * page_size); };

  for (int64_t j = 0; j < used_pages; ++j) {
    const float* keys = page_base(k_pages, j);
    const int64_t first = j * page_size;
    for (int64_t s = 0; s < slots_in(j); ++s) {
      for (int64_t r = 0; r < g; ++r) {
        logits[r * length + first + s] = Dot(scaled_q + r * h, keys + s * h, h);
      }
    }
  }

  // One exp per slot; the division by the sum comes after the value product.
  for (int64_t r = 0; r < g; ++r) {
    float* row = logits + r * length;
    float top = row[0];
    for (int64_t s = 1; s < length; ++s) top = std::max(top, row[s]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < length; ++s) {
      row[s] = ExpNonPositive(row[s] - top);
      sum += row[s];
    }
    inv_sum[r] = 1.0f / sum;  // sum >= 1: the top slot adds exp(0)
  }

  std::fill(out, out + g * h, 0.0f);
  for (int64_t j = 0; j < used_pages; ++j) {
    const float* values = page_base(v_pages, j);
    const int64_t first = j * page_size;
    for (int64_t s = 0; s < slots_in(j); ++s) {
      const float* value = values + s * h;
      for (int64_t r = 0; r < g; ++r) {
        const float w = logits[r * length + first + s];
        float* acc = out + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) acc[i] += w * value[i];
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    for (int64_t i = 0; i < h; ++i) out[r * h + i] *= inv_sum[r];
  }
}

// All (sequence, KV head)s; shapes as in the header comment, G = N / K. Lengths
// are clamped into [0, P_max * S_page].
void PagedAttention(const float* q, const float* k_pages, const float* v_pages,
                    const int32_t* page_table, const int32_t* lengths, int64_t b,
                    int64_t kv_heads, int64_t g, int64_t h, int64_t num_pages,
                    int64_t page_size, int64_t max_pages, float* out) {
  for (int64_t i = 0; i < b * kv_heads; ++i) {
    const int64_t length = std::clamp<int64_t>(lengths[i], 0, max_pages * page_size);
    AttendHead(q + i * g * h, k_pages, v_pages, page_table + i * max_pages, num_pages,
               page_size, length, g, h, out + i * g * h);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error PagedAttentionCpu(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                             ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions();
  const auto td = page_table.dimensions(), ld = lengths.dimensions(), od = out->dimensions();
  const bool ranks_ok = qd.size() == 3 && kd.size() == 3 && vd.size() == 3 &&
                        td.size() == 3 && ld.size() == 2 && od.size() == 3;
  if (!ranks_ok || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      !std::equal(qd.begin(), qd.end(), od.begin()) || kd[2] != qd[2] || td[0] != qd[0] ||
      ld[0] != td[0] || ld[1] != td[1] || td[1] == 0 || qd[1] % td[1] != 0 || kd[0] == 0 ||
      kd[1] == 0) {
    return ffi::Error::InvalidArgument(
        "kvjax_paged_attention_cpu: inconsistent shapes q" + Shape(qd) + " k_pages" +
        Shape(kd) + " v_pages" + Shape(vd) + " page_table" + Shape(td) + " lengths" +
        Shape(ld));
  }
  PagedAttention(q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                 page_table.typed_data(), lengths.typed_data(), qd[0], td[1], qd[1] / td[1],
                 qd[2], kd[0], kd[1], td[2], out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedAttentionCpu, PagedAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
