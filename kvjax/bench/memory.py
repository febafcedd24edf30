"""The memory a bench configuration needs, estimated before it runs, and the device's.

The bench refuses a configuration whose estimate exceeds the memory of the
device it would run on, before running anything, so that a batch or a length
that cannot fit fails in one line instead of after minutes of growth.

  estimate = weights + cache + activations     (bytes)

weights
  The loaded parameters: the sum of their ``nbytes`` (float32, or GGUF blocks
  with ``--packed``).

cache
  The ``PagedKVCache`` the run allocates, sized exactly as the run sizes it.
  Each layer l has a capacity C_l per KV head: ``policy.layout(budget,
  prompt_len=T, extra_tokens=0, max_new_tokens=steps + 1, page_size, ...)``'s
  (the full cache: T + steps + 1 rounded up to a page), where T is the context
  length for a synthetic fill and, for a prompt, its token count rounded up
  to the prefill chunk or to generate's pad multiple (64); with a prefill
  chunk each capacity is at most round_up(T + steps + 1, S_page). Then
  ``PagedKVCache.create`` holds

    P = B * K * sum_l C_l / S_page                pages
    keys + values       2 * P * S_page * H * itemsize      (``kv_bytes``: exact)
    positions + scores  2 * P * S_page * 4
    page table          B * L * K * max_l(C_l) / S_page * 4
    lengths, free stack B * L * K * 4 + P * 4 + 4

activations
  A rough bound of the largest transient of one forward pass (layers run one
  after another, so one layer's): float32, T_q query tokens attending over
  T_kv entries,

    residual stream, normed input, attention output   3 * B * T_q * D
    q, k, v                                            B * T_q * (N + 2K) * H
    attention logits and probabilities of one block    2 * B * N * min(T_q, 512) * T_kv
    MLP gate, up and their product                     3 * B * T_q * F
    next-token logits                                  B * V

  Prompt fill: T_q = T (one-shot prefill, T_kv = T) or the chunk (T_kv = the
  largest capacity). Synthetic fill: the fill program's random keys and values
  of one layer, 2 * B * T * K * H * itemsize. Decode steps (T_q = 1, T_kv = the
  largest capacity) cost less than either. Compiled programs, XLA's own
  buffers and the Python process are left out: the measured peaks
  (``peak_rss_bytes``, ``buffer_peak_bytes``) run above the estimate.
"""

from __future__ import annotations

import dataclasses
import os

from kvjax.cache.paged import round_up

# generate's default pad multiple and prefill attention block (kvjax.generate).
PAD_MULTIPLE = 64
ATTENTION_BLOCK = 512
INT32 = 4
FLOAT32 = 4


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes a configuration needs, by part."""

  weights: int
  cache: int
  kv: int  # keys and values of the cache (part of ``cache``)
  activations: int

  @property
  def total(self) -> int:
    return self.weights + self.cache + self.activations

  def parts(self) -> dict:
    return {"weights": self.weights, "cache": self.cache, "kv": self.kv,
            "activations": self.activations}


def prompt_len(tokens: int, prefill_chunk: int) -> int:
  """T: a prompt's length as generate pads it (to the chunk, else to the pad multiple)."""
  return round_up(tokens, prefill_chunk or PAD_MULTIPLE)


def cache_capacity(policy, *, budget: int | None, prompt_len: int, new_tokens: int,
                   page_size: int, num_layers: int, num_kv_heads: int = 1,
                   prefill_chunk: int = 0) -> tuple[int, ...]:
  """C_l: slots per KV head of each layer, as generate's plan (and the synthetic fill) sets them.

  Every layer is sized as a global one (the bench's cache has no rings).

  Raises:
    ValueError: a policy whose KV heads differ in size (AdaKV, Duo).
  """
  layout = policy.layout(budget, prompt_len=prompt_len, extra_tokens=0,
                         max_new_tokens=new_tokens, page_size=page_size,
                         num_kv_heads=num_kv_heads, windows=(0,) * num_layers)
  if layout.per_head:
    raise ValueError(f"policy {policy.name!r} gives its KV heads sizes of their own "
                     "(a per-head layout): kvjax.generate and the eval run it; the "
                     "benchmark's cache, one size per layer, does not")
  capacity = layout.capacity
  if prefill_chunk:
    whole = round_up(prompt_len + new_tokens, page_size)
    capacity = tuple(min(c, whole) for c in capacity)
  return tuple(capacity)


def cache_bytes(config, capacity: tuple[int, ...], *, batch_size: int, page_size: int,
                itemsize: int) -> tuple[int, int]:
  """(every array of the cache, its keys and values) in bytes, as PagedKVCache.create allocates."""
  b, l, k, h = batch_size, config.num_layers, config.num_kv_heads, config.head_dim
  pages = b * k * sum(c // page_size for c in capacity)
  kv = 2 * pages * page_size * h * itemsize
  slots = 2 * pages * page_size * INT32  # positions (int32) and scores (float32)
  table = b * l * k * (max(capacity) // page_size) * INT32
  return kv + slots + table + b * l * k * INT32 + pages * INT32 + INT32, kv


def forward_bytes(config, *, batch_size: int, query_tokens: int, kv_tokens: int) -> int:
  """A rough bound of one layer's transient buffers plus the next-token logits (float32)."""
  b, t, c = batch_size, query_tokens, config
  elements = (3 * b * t * c.hidden_size
              + b * t * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
              + 2 * b * c.num_heads * min(t, ATTENTION_BLOCK) * kv_tokens
              + 3 * b * t * c.intermediate_size
              + b * c.vocab_size)
  return elements * FLOAT32


def estimate(config, *, weights: int, itemsize: int, policy, budget: int | None,
             context_length: int, batch_size: int, decode_steps: int, fill: str,
             prefill_chunk: int = 0, page_size: int = 16,
             prompt_tokens: int | None = None) -> Estimate:
  """The estimate of one bench configuration (see the module docstring).

  Args:
    config: the model's LlamaConfig.
    weights: bytes of the loaded parameters.
    itemsize: bytes of one key or value element (the model's dtype).
    policy: the configuration's policy object; budget: its budget (None: full).
    fill: "prompt" or "synthetic" (resolved, not "auto").
    prompt_tokens: a prompt's actual token count (default: the context length).
  """
  new_tokens = decode_steps + 1  # the first token comes from the prefill's logits
  if fill == "prompt":
    t = prompt_len(prompt_tokens or context_length, prefill_chunk)
    chunk = prefill_chunk
  else:
    t, chunk = context_length, 0
  capacity = cache_capacity(policy, budget=budget, prompt_len=t, new_tokens=new_tokens,
                            page_size=page_size, num_layers=config.num_layers,
                            num_kv_heads=config.num_kv_heads, prefill_chunk=chunk)
  cache, kv = cache_bytes(config, capacity, batch_size=batch_size, page_size=page_size,
                          itemsize=itemsize)
  widest = max(capacity)
  decode = forward_bytes(config, batch_size=batch_size, query_tokens=1, kv_tokens=widest)
  if fill == "prompt":
    q = min(chunk or t, t)
    fill_bytes = forward_bytes(config, batch_size=batch_size, query_tokens=q,
                               kv_tokens=widest if chunk else t)
  else:
    fill_bytes = 2 * batch_size * t * config.num_kv_heads * config.head_dim * itemsize
  return Estimate(weights=weights, cache=cache, kv=kv, activations=max(decode, fill_bytes))


def available_bytes() -> tuple[int | None, str]:
  """(bytes a run may use on the default device, where that figure comes from).

  A GPU or TPU: its allocator's ``bytes_limit`` (``memory_stats``). A CPU: the
  memory the system can give without swapping (MemAvailable in /proc/meminfo,
  else the free physical pages). (None, why) where neither is known.
  """
  import jax
  device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
      return int(stats["bytes_limit"]), f"{device.platform} memory (bytes_limit)"
    return None, f"{device.platform} reports no memory limit"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, "available host memory (MemAvailable)"
  except OSError:
    pass
  try:
    return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
            "free host memory (SC_AVPHYS_PAGES)")
  except (ValueError, OSError):
    return None, "host memory unknown"


def human(n: float) -> str:
  """Bytes as B / KiB / MiB / GiB / TiB with 3 significant digits."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
    if abs(n) < 1024 or unit == "PiB":
      return f"{n:.3g} {unit}"
    n /= 1024
  return f"{n:.3g} PiB"
