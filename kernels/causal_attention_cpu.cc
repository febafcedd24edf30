// Causal GQA attention over right-padded prompts on CPU, an XLA FFI custom call.
//
// The computation of kvjax.cache.attention.causal_attention (its XLA form is
// the reference), shapes as there:
//   q     [B, T, N, H]  float32
//   k, v  [B, T, K, H]  float32
//   out   [B, T, N, H]  float32
// Query t of a sequence attends to its keys 0..t; query head n reads KV head
// n / G (G = N / K). Padding sits after each sequence's tokens, so the causal
// mask alone keeps the valid queries clean.
//
// Why it exists: XLA runs each step of a blockwise attention as separate
// passes (logits, max, exp, sums, values), each writing its block of logits
// out and reading it back. Here, as in flash attention, each (sequence, KV
// head, block of queries) stacks its G query heads' rows, then visits the key
// blocks up to the diagonal: logits Q K^T into a tile that stays in the core's
// L2 cache, the diagonal block masked, an online softmax (a running max and
// sum per row) over the tile in place, then O += P V. Both products run
// cpu_tile.h's register tile. XLA's intra-op threads claim the query blocks, the
// costliest (last) first.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "cpu_tile.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kvjax::Product;

constexpr int64_t kKeyBlock = 128;      // keys per block: the logits tile's width
constexpr int64_t kRowsPerBlock = 192;  // query rows (G heads x tokens) per block

struct Shape4 {
  int64_t b, t, n, k, h;  // batch, tokens, query heads, KV heads, head dim
};

// Scratch of one query block, reused by a thread across blocks.
struct Scratch {
  std::vector<float> q, o, m, l, logits, keys, values;
};

// One (sequence, KV head, query block): rows r = g * tokens + i for the
// block's query token t0 + i and query head kv * G + g.
void QueryBlock(const float* q, const float* k, const float* v, float* out, const Shape4& s,
                int64_t seq, int64_t kv, int64_t t0, int64_t tokens, Scratch& w) {
  const int64_t g = s.n / s.k, h = s.h, rows = g * tokens, h_pad = (h + 15) / 16 * 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(h));
  w.q.assign(rows * h, 0.0f);
  w.o.assign(rows * h_pad, 0.0f);
  w.m.assign(rows, -INFINITY);
  w.l.assign(rows, 0.0f);
  w.logits.resize(rows * kKeyBlock);
  w.keys.resize(h * kKeyBlock);        // [K block / 16 panels][H][16]
  w.values.resize(kKeyBlock * h_pad);  // [K block][H padded to 16]
  const int64_t last = std::min(t0 + tokens, s.t);  // queries [t0, last) are real
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int64_t i = 0; i < last - t0; ++i) {
      const float* src = q + ((seq * s.t + t0 + i) * s.n + kv * g + gi) * h;
      float* dst = w.q.data() + (gi * tokens + i) * h;
      for (int64_t d = 0; d < h; ++d) dst[d] = src[d] * scale;
    }
  }
  for (int64_t s0 = 0; s0 < last; s0 += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, s.t - s0);
    const int64_t cols = (keys + 15) / 16 * 16;
    // Keys as 16-key panels of [H][16]; values as rows; zeros past the last key.
    std::fill(w.keys.begin(), w.keys.end(), 0.0f);
    std::fill(w.values.begin(), w.values.end(), 0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      const float* kj = k + ((seq * s.t + s0 + j) * s.k + kv) * h;
      const float* vj = v + ((seq * s.t + s0 + j) * s.k + kv) * h;
      float* panel = w.keys.data() + (j / 16) * h * 16 + j % 16;
      for (int64_t d = 0; d < h; ++d) panel[d * 16] = kj[d];
      std::copy(vj, vj + h, w.values.data() + j * h_pad);
    }
    float* logits = w.logits.data();
    Product(rows, cols, h, w.q.data(), h, w.keys.data(), 16, h * 16, logits, kKeyBlock, false);
    const bool masked = s0 + cols - 1 > t0;  // a key after some query of the block
    for (int64_t r = 0; r < rows; ++r) {
      float* row = logits + r * kKeyBlock;
      if (masked) {  // key s0 + j is seen by query t0 + i when s0 + j <= t0 + i
        const int64_t seen = std::clamp<int64_t>(t0 + r % tokens - s0 + 1, 0, cols);
        for (int64_t j = seen; j < cols; ++j) row[j] = -INFINITY;
      }
      const float top = kvjax::RowMax(row, cols, w.m[r]);
      const float rescale = kvjax::ExpNonPositive(w.m[r] - top);  // 0 on the first block
      w.m[r] = top;
      w.l[r] = w.l[r] * rescale + kvjax::ExpShiftedSum(row, cols, top);
      float* o = w.o.data() + r * h_pad;
      for (int64_t d = 0; d < h_pad; ++d) o[d] *= rescale;
    }
    Product(rows, h_pad, cols, logits, kKeyBlock, w.values.data(), h_pad, 16, w.o.data(), h_pad,
            true);
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int64_t i = 0; i < last - t0; ++i) {
      const int64_t r = gi * tokens + i;
      const float inv = 1.0f / w.l[r];  // >= 1: each query sees its own key
      float* dst = out + ((seq * s.t + t0 + i) * s.n + kv * g + gi) * h;
      for (int64_t d = 0; d < h; ++d) dst[d] = w.o[r * h_pad + d] * inv;
    }
  }
}

template <typename Schedule>
void CausalAttention(const float* q, const float* k, const float* v, float* out,
                     const Shape4& s, int64_t threads, Schedule&& schedule) {
  const int64_t g = s.n / s.k;
  const int64_t tokens = std::clamp<int64_t>(kRowsPerBlock / g, 8, 64);
  const int64_t blocks = (s.t + tokens - 1) / tokens, heads = s.b * s.k;
  kvjax::RunParts(blocks * heads, threads, schedule, [=](int64_t p) {
    thread_local Scratch scratch;
    const int64_t block = blocks - 1 - p / heads, head = p % heads;  // last blocks first
    QueryBlock(q, k, v, out, s, head / s.k, head % s.k, block * tokens, tokens, scratch);
  });
}

std::string ShapeText(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error CausalAttentionCpu(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ThreadPool pool) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      vd.size() != 4 || od.size() != 4 || !std::equal(qd.begin(), qd.end(), od.begin()) ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("kvjax_causal_attention_cpu: inconsistent shapes q" +
                                       ShapeText(qd) + " k" + ShapeText(kd) + " v" +
                                       ShapeText(vd));
  }
  const Shape4 s{qd[0], qd[1], qd[2], kd[2], qd[3]};
  CausalAttention(q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(), s,
                  std::max<int64_t>(1, pool.num_threads()),
                  [&pool](auto task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxCausalAttentionCpu, CausalAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ctx<ffi::ThreadPool>());
