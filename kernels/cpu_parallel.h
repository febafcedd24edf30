// Work split over XLA's intra-op threads, shared by the native CPU kernels.
//
// RunParts(n, threads, schedule, fn) calls fn(p) once for each p in [0, n):
// the calling thread and up to threads - 1 helpers (started with
// schedule(task), XLA's ThreadPool::Schedule in a kernel, plain threads in
// the sanitizer checks) claim parts one at a time. The caller never waits for
// a helper to start, only for the parts a helper has claimed to finish, so a
// busy or single-threaded pool cannot deadlock it.

#ifndef KVJAX_KERNELS_CPU_PARALLEL_H_
#define KVJAX_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

namespace kvjax {

// Held by shared_ptr: a helper that starts after the call has returned finds
// no part left and touches nothing else (fn, which holds pointers into the
// finished call, is never invoked again).
struct PartQueue {
  int64_t total = 0;
  std::function<void(int64_t)> fn;
  std::atomic<int64_t> next{0};  // the next part to claim
  std::atomic<int64_t> done{0};  // parts finished

  void Drain() {
    for (int64_t p; (p = next.fetch_add(1)) < total; done.fetch_add(1)) fn(p);
  }
};

template <typename Schedule>
void RunParts(int64_t parts, int64_t threads, Schedule&& schedule,
              std::function<void(int64_t)> fn) {
  if (parts <= 0) return;
  auto queue = std::make_shared<PartQueue>();
  queue->total = parts;
  queue->fn = std::move(fn);
  const int64_t helpers = std::min(threads, parts) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    schedule([queue]() {
      if (queue->next.load() < queue->total) queue->Drain();
    });
  }
  queue->Drain();
  while (queue->done.load() < parts) std::this_thread::yield();
}

}  // namespace kvjax

#endif  // KVJAX_KERNELS_CPU_PARALLEL_H_
