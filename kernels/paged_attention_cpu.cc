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
// head's pages are read in place, keys once and values once, each read
// serving the head's G query heads. A head's pages are cut into parts that
// XLA's intra-op threads share (split-K, as flash-decoding): each part keeps a
// softmax state, and the states of a head are merged at the end.
//
// Only slots below the length are read, so stale or non-finite data past it
// (or in pages a head does not own) never reaches the output. Page ids are
// clamped into [0, P) as XLA's gather clamps them. A head of length 0 gives
// zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Dot(const float* a, const float* b, int64_t h) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += a[i] * b[i];
  return sum;
}

// A run of pages of one (sequence, KV head): pages [first_page, end_page) of
// its page table, the last one cut at the head's length.
struct Part {
  int64_t head;  // (sequence, KV head), flattened: b * K + k
  int64_t first_page, end_page;
};

// The softmax state of one part for the head's G query rows: running max
// m [G], sum l [G] = sum exp(logit - m), acc [G, H] = sum exp(logit - m) v.
// Parts of one head merge into the head's output (Merge).
void AttendPart(const float* q, const float* k_pages, const float* v_pages,
                const int32_t* pages, int64_t num_pages, int64_t page_size, int64_t length,
                int64_t first_page, int64_t end_page, int64_t g, int64_t h, float* m, float* l,
                float* acc) {
  const int64_t first_slot = first_page * page_size;
  const int64_t slots = std::min(end_page * page_size, length) - first_slot;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(g * (h + slots)));
  float* scaled_q = scratch.data();  // [G, H]
  float* logits = scaled_q + g * h;  // [G, slots], then exp(logit - m)
  const float scale = 1.0f / std::sqrt(static_cast<float>(h));
  for (int64_t i = 0; i < g * h; ++i) scaled_q[i] = q[i] * scale;

  auto page_base = [&](const float* pool, int64_t j) {
    const int64_t id = std::clamp<int64_t>(pages[j], 0, num_pages - 1);
    return pool + id * page_size * h;
  };
  auto slots_in = [&](int64_t j) { return std::min(page_size, length - j * page_size); };

  // Keys once: each key serves the G query rows while it is in cache.
  for (int64_t j = first_page; j < end_page; ++j) {
    const float* keys = page_base(k_pages, j);
    const int64_t at = j * page_size - first_slot;
    for (int64_t s = 0; s < slots_in(j); ++s) {
      for (int64_t r = 0; r < g; ++r) {
        logits[r * slots + at + s] = Dot(scaled_q + r * h, keys + s * h, h);
      }
    }
  }
  // One exp per slot; the division by the sum comes after the merge.
  for (int64_t r = 0; r < g; ++r) {
    float* row = logits + r * slots;
    float top = row[0];
    for (int64_t s = 1; s < slots; ++s) top = std::max(top, row[s]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < slots; ++s) {
      row[s] = kvjax::ExpNonPositive(row[s] - top);
      sum += row[s];
    }
    m[r] = top;
    l[r] = sum;  // >= 1: the top slot adds exp(0)
  }
  // Values once.
  std::fill(acc, acc + g * h, 0.0f);
  for (int64_t j = first_page; j < end_page; ++j) {
    const float* values = page_base(v_pages, j);
    const int64_t at = j * page_size - first_slot;
    for (int64_t s = 0; s < slots_in(j); ++s) {
      const float* value = values + s * h;
      for (int64_t r = 0; r < g; ++r) {
        const float w = logits[r * slots + at + s];
        float* row = acc + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) row[i] += w * value[i];
      }
    }
  }
}

// out [G, H] of one head from the states of its n parts (m [n, G], l [n, G],
// acc [n, G, H]); zeros for a head without parts (length 0).
void Merge(const float* m, const float* l, const float* acc, int64_t n, int64_t g, int64_t h,
           float* out) {
  std::fill(out, out + g * h, 0.0f);
  for (int64_t r = 0; r < g; ++r) {
    float top = -INFINITY;
    for (int64_t p = 0; p < n; ++p) top = std::max(top, m[p * g + r]);
    float sum = 0.0f;
    for (int64_t p = 0; p < n; ++p) {
      const float w = std::exp(m[p * g + r] - top);
      sum += w * l[p * g + r];
      const float* part = acc + (p * g + r) * h;
      for (int64_t i = 0; i < h; ++i) out[r * h + i] += w * part[i];
    }
    if (n > 0) {
      for (int64_t i = 0; i < h; ++i) out[r * h + i] /= sum;
    }
  }
}

// Smallest run of pages worth a part of its own (a part costs a merge).
constexpr int64_t kMinPagesPerPart = 8;

// All (sequence, KV head)s; shapes as in the header comment, G = N / K.
// Lengths are clamped into [0, P_max * S_page]. Each head's pages are cut into
// parts, which up to `threads` threads share (kvjax::RunParts).
template <typename Schedule>
void PagedAttention(const float* q, const float* k_pages, const float* v_pages,
                    const int32_t* page_table, const int32_t* lengths, int64_t b,
                    int64_t kv_heads, int64_t g, int64_t h, int64_t num_pages,
                    int64_t page_size, int64_t max_pages, float* out, int64_t threads,
                    Schedule&& schedule) {
  const int64_t heads = b * kv_heads;
  auto length_of = [=](int64_t i) {
    return std::clamp<int64_t>(lengths[i], 0, max_pages * page_size);
  };
  // Two parts per thread in all, where heads are long enough to cut.
  const int64_t cuts = std::max<int64_t>(1, (2 * threads + heads - 1) / heads);
  std::vector<Part> parts;
  std::vector<int64_t> first_part(heads + 1);
  for (int64_t i = 0; i < heads; ++i) {
    first_part[i] = static_cast<int64_t>(parts.size());
    const int64_t used = (length_of(i) + page_size - 1) / page_size;
    const int64_t n = std::min(cuts, std::max<int64_t>(1, used / kMinPagesPerPart));
    for (int64_t p = 0; p < n && used > 0; ++p) {
      parts.push_back({i, used * p / n, used * (p + 1) / n});
    }
  }
  first_part[heads] = static_cast<int64_t>(parts.size());
  const int64_t total = first_part[heads];
  std::vector<float> state(static_cast<size_t>(total * g * (h + 2)));
  float* m = state.data();   // [parts, G]
  float* l = m + total * g;  // [parts, G]
  float* acc = l + total * g;  // [parts, G, H]

  const Part* part_list = parts.data();
  kvjax::RunParts(total, threads, schedule, [=](int64_t p) {
    const Part& part = part_list[p];
    AttendPart(q + part.head * g * h, k_pages, v_pages, page_table + part.head * max_pages,
               num_pages, page_size, length_of(part.head), part.first_page, part.end_page, g, h,
               m + p * g, l + p * g, acc + p * g * h);
  });
  for (int64_t i = 0; i < heads; ++i) {
    const int64_t p = first_part[i];
    Merge(m + p * g, l + p * g, acc + p * g * h, first_part[i + 1] - p, g, h, out + i * g * h);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error PagedAttentionCpu(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                             ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out,
                             ffi::ThreadPool pool) {
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
                 qd[2], kd[0], kd[1], td[2], out->typed_data(),
                 std::max<int64_t>(1, pool.num_threads()),
                 [&pool](auto task) { pool.Schedule(std::move(task)); });
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
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ctx<ffi::ThreadPool>());  // XLA's intra-op threads
