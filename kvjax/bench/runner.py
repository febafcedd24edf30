"""One benchmark measurement: decode speed, prefill time and memory of a policy at a length.

Two ways to fill the cache before decoding:
  "prompt"     a real NIAH prompt of the context length through ``kvjax.generate``
               (prefill + compression timed too); only up to the model's context.
  "synthetic"  random keys and values of the right shapes written into the
               cache through its own API (the full cache holds the context
               length, a policy its budget), then the same compiled decode
               loop. A decode step costs the same whatever the numbers are,
               so this measures decoding at cache lengths past the model's
               context or a CPU's patience.
Each timing follows a warm-up run of the same compiled program and ends with
``block_until_ready``. ``decode_steps`` is the number of decode forward passes
timed: the run generates decode_steps + 1 tokens, the first of them sampled
from the prefill's logits (no step of its own), so ``decode_ms_per_token`` is
the time of one step exactly.

With a compilation cache (JAX's persistent cache, ``compilation_cache``), a
program compiled by an earlier run is loaded from it instead of compiled; the
row counts both (``programs_compiled``, ``programs_from_cache``). The
compiler's transient memory (~200 MiB for SmolLM2's chunked-prefill program)
is then not in the process's peak: the memory of running, as a server that
compiled its programs ahead of time would see it.
"""

from __future__ import annotations

import dataclasses
import functools
import resource

import jax
import jax.numpy as jnp

from kvjax import buffer_memory
from kvjax.bench import memory
from kvjax.eval import policy_entries


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """One measurement.

  The policy runs at its defaults, under ``window`` when nonzero (every policy
  that has an observation window, H2O's recent window) and ``entry_fields``
  (the fields of its ``--policies`` entry, ``kvjax.eval.policy_entries``),
  which win.
  """

  model: str = "smollm2-135m-instruct"
  policy: str = "full"
  entry_fields: tuple[tuple[str, object], ...] = ()  # (field, value) pairs, sorted by field
  budget: int | None = None  # None for the full cache
  context_length: int = 4096
  batch_size: int = 1
  decode_steps: int = 32
  prefill_chunk: int = 0
  backend: str = "auto"
  fill: str = "auto"  # "auto": a real prompt where it fits the model's context
  repeats: int = 3
  window: int = 0  # observation window of every policy that has one; 0 = each one's default
  page_size: int = 16
  scan_layers: bool = True  # False: per-layer weights, layers unrolled (kvjax.load)
  packed: bool = False  # GGUF Q4_1 / Q8_0 matrices kept as their blocks (kvjax.load)
  compilation_cache: str | None = None  # JAX's persistent compilation cache folder
  mesh: str = ""  # "data:2,model:4": a device mesh (kvjax.sharding.make_mesh); "" one device

  def __post_init__(self):
    # A child process gets its configuration as JSON, where the pairs are lists.
    object.__setattr__(self, "entry_fields", tuple(tuple(p) for p in self.entry_fields))

  @property
  def entry(self) -> policy_entries.PolicyEntry:
    """The policy's ``--policies`` entry."""
    return policy_entries.PolicyEntry(self.policy, self.entry_fields)

  @property
  def policy_fields(self) -> dict:
    """The fields set explicitly: ``window``'s (when nonzero), then the entry's."""
    return self.entry.run_fields(self.window)

  @property
  def label(self) -> str:
    """``name (field=value, ...)``: the policy and the fields set explicitly."""
    return policy_entries.label(self.policy, self.policy_fields)


def peak_rss_bytes() -> int:
  """This process's peak resident set size so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes(field: str = "VmRSS") -> int | None:
  """This process's resident set size now (Linux /proc), else None.

  ``field``: "VmRSS" (all of it), "RssAnon" (heap and other anonymous memory)
  or "RssFile" (mapped files' pages: mostly the jax library's code).
  """
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


_PROGRAMS = {"programs": 0, "from_cache": 0}


@functools.cache
def _count_programs() -> None:
  """Counts, from here on, the programs this process compiles or loads from the cache."""
  def on_duration(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # compiled or loaded
      _PROGRAMS["programs"] += 1

  def on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      _PROGRAMS["from_cache"] += 1

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)


def use_compilation_cache(folder: str) -> None:
  """Programs are loaded from (and, compiled, saved to) JAX's persistent cache in ``folder``.

  Every program counts, however quick its compilation (JAX's default saves
  only those that took a second or more).
  """
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def device_peak_bytes() -> int | None:
  """Peak device memory where the backend reports it (GPU/TPU), else None (CPU)."""
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def new_tokens(cfg: BenchConfig) -> int:
  """Tokens a run generates: the timed steps and the first token, which the prefill gives."""
  return cfg.decode_steps + 1


def resolve_fill(cfg: BenchConfig, model_config) -> str:
  """"prompt" or "synthetic" (``cfg.fill`` "auto": a prompt where it fits the model's context).

  Raises ValueError for a prompt that does not fit, and for a synthetic fill
  of a model with sliding-window layers: ``synthetic_cache`` lays every layer
  out at its budget, where generate keeps a local layer's window as a ring, so
  its memory and step time would not be the model's.
  """
  context = model_config.max_position_embeddings
  fits = cfg.context_length + new_tokens(cfg) <= context
  fill = cfg.fill if cfg.fill != "auto" else ("prompt" if fits else "synthetic")
  if fill == "prompt" and not fits:
    raise ValueError(f"a {cfg.context_length}-token prompt + {new_tokens(cfg)} new tokens "
                     f"exceeds the model's context of {context}; use --fill=synthetic")
  if fill == "synthetic" and any(model_config.layer_windows):
    raise ValueError(f"{model_config.name} has sliding-window layers, whose cache is a ring "
                     "that the synthetic fill does not build; use --fill=prompt (context "
                     f"lengths up to {context - new_tokens(cfg)})")
  return fill


def make_policy(cfg: BenchConfig, tokenizer=None):
  """The configuration's policy (its fields set), bound; ValueError for a bad budget."""
  policy = cfg.entry.make(cfg.window)
  if tokenizer is not None:
    policy = policy.bind(tokenizer)
  policy.validate(cfg.budget)
  return policy


def estimate_memory(cfg: BenchConfig, lm, prompt_tokens: int | None = None) -> memory.Estimate:
  """The configuration's memory estimate (kvjax.bench.memory) for the loaded model ``lm``."""
  weights = sum(x.nbytes for x in jax.tree.leaves(lm.params))
  return memory.estimate(
      lm.config, weights=weights, itemsize=jnp.dtype(lm.dtype).itemsize,
      policy=make_policy(cfg), budget=cfg.budget, context_length=cfg.context_length,
      batch_size=cfg.batch_size, decode_steps=cfg.decode_steps,
      fill=resolve_fill(cfg, lm.config), prefill_chunk=cfg.prefill_chunk,
      page_size=cfg.page_size, prompt_tokens=prompt_tokens)


def measure(cfg: BenchConfig, lm=None) -> dict:
  """Runs one configuration; returns its row (timings, bytes, how the cache was filled)."""
  import kvjax
  _count_programs()
  if cfg.compilation_cache:
    use_compilation_cache(cfg.compilation_cache)
  before = dict(_PROGRAMS)
  if lm is None:
    lm = kvjax.load(cfg.model, scan_layers=cfg.scan_layers, packed=cfg.packed)
  fill = resolve_fill(cfg, lm.config)
  policy = make_policy(cfg, lm.tokenizer)
  if cfg.mesh and fill != "prompt":
    raise ValueError("--mesh measures prompt runs only (a synthetic fill writes a one-device "
                     "cache); use --fill=prompt")
  load_peak, rss_loaded, rss_file = peak_rss_bytes(), rss_bytes(), rss_bytes("RssFile")
  run = _prompt_run if fill == "prompt" else synthetic_decode
  with buffer_memory.track() as buffers:
    row = run(lm, cfg, policy)
  decode_s = row.pop("decode_s")
  steps = row.pop("steps")  # forward passes timed: cfg.decode_steps (no stop id ends a run)
  estimate = estimate_memory(cfg, lm, prompt_tokens=row["prompt_tokens"])
  row.update({
      "model": cfg.model, "policy": cfg.policy, "policy_fields": cfg.policy_fields,
      "policy_settings": policy_entries.settings(policy, cfg.policy_fields),
      "budget": cfg.budget, "context_length": cfg.context_length,
      "batch_size": cfg.batch_size, "decode_steps": cfg.decode_steps,
      "decode_note": (f"decode_s times {steps} decode steps (one forward pass each) of "
                      f"{steps + 1} generated tokens: the first comes from the prefill's "
                      "logits; decode_ms_per_token = decode_s / steps"),
      "prefill_chunk": cfg.prefill_chunk,
      "fill": fill, "backend": kvjax.backend.resolve(cfg.backend), "scan_layers": lm.scan_layers,
      "packed": lm.packed,
      "device": jax.devices()[0].platform,
      "mesh": cfg.mesh, "kv_bytes_per_device": row.pop("kv_bytes_per_device", row["kv_bytes"]),
      "decode_ms_per_token": 1e3 * decode_s / steps,
      "decode_tokens_per_s": cfg.batch_size * steps / decode_s,
      "peak_rss_bytes": peak_rss_bytes(), "rss_after_load_bytes": rss_loaded,
      "load_peak_rss_bytes": load_peak, "rss_file_after_load_bytes": rss_file,
      "device_peak_bytes": device_peak_bytes(),
      "buffer_peak_bytes": buffers.bytes, "buffer_peak_program": buffers.program,
      "estimated_bytes": estimate.total, "estimated_parts": estimate.parts(),
      "compilation_cache": cfg.compilation_cache,
      "programs_compiled": (_PROGRAMS["programs"] - before["programs"]
                            - _PROGRAMS["from_cache"] + before["from_cache"]),
      "programs_from_cache": _PROGRAMS["from_cache"] - before["from_cache"],
      "memory_note": ("peak_rss_bytes: the process's peak resident set (ru_maxrss), model "
                      "loading included; rss_after_load_bytes: the resident set once the "
                      "model is loaded (VmRSS), load_peak_rss_bytes: the peak by then, "
                      "rss_file_after_load_bytes: mapped files' pages in it (RssFile; "
                      "mostly jaxlib's code, more when the library's files were written "
                      "recently, e.g. by pip, than once read back from disk); "
                      "device_peak_bytes: memory_stats() where the backend has it; "
                      "buffer_peak_bytes: the most bytes of live jax arrays plus a program's "
                      "scratch and new outputs at the start of any program run "
                      "(kvjax.buffer_memory), any backend; programs_compiled / "
                      "programs_from_cache: the programs this measurement compiled / "
                      "loaded from the compilation cache (loaded: the compiler's memory "
                      "is not in the peaks); estimated_bytes: weights + cache + "
                      "activations as kvjax.bench.memory estimates them before running "
                      "(estimated_parts; the cache's kv part is exact: kv_bytes)"),
  })
  return row


def _prompt_run(lm, cfg: BenchConfig, policy) -> dict:
  import kvjax
  sample = kvjax.tasks.make_sample(lm.require_tokenizer("the bench's prompt"), "niah",
                                   length=cfg.context_length)
  prompts = [sample.prompt] * cfg.batch_size
  kwargs = dict(policy=policy, budget=cfg.budget, max_new_tokens=new_tokens(cfg),
                stop_ids=[], backend=cfg.backend, page_size=cfg.page_size,
                prefill_chunk=cfg.prefill_chunk,
                mesh=kvjax.sharding.make_mesh(cfg.mesh) if cfg.mesh else None)
  # Only the stats are kept: a run's result holds its cache, and a measured
  # run's peak should not include an earlier run's cache.
  first = kvjax.generate(lm, prompts, **kwargs).stats  # warm-up: compiles every program
  runs = [kvjax.generate(lm, prompts, **kwargs).stats for _ in range(cfg.repeats)]
  best = min(runs, key=lambda r: r.decode_s)
  return {"prefill_s": min(r.prefill_s for r in runs), "decode_s": best.decode_s,
          "steps": best.decode_steps, "compile_s": first.compile_s,
          "kv_bytes": best.kv_bytes, "kv_bytes_per_device": best.kv_bytes_per_device,
          "prompt_tokens": best.prompt_tokens[0]}


def cache_budgets(lm, cfg: BenchConfig, policy) -> tuple[int, ...]:
  """Entries per layer ``policy`` keeps of a ``context_length`` prompt (all of it for full)."""
  n, num_layers = cfg.context_length, lm.config.num_layers
  if not cfg.budget:
    return (n,) * num_layers
  # Every layer sized as a global one: the bench's cache has no rings.
  budgets = policy.layout(cfg.budget, prompt_len=n, extra_tokens=0,
                          max_new_tokens=new_tokens(cfg), page_size=cfg.page_size,
                          num_kv_heads=lm.config.num_kv_heads,
                          windows=(0,) * num_layers).budgets
  return tuple(min(b, n) for b in budgets)


def synthetic_cache(lm, cfg: BenchConfig, policy, seed: int = 0):
  """A cache filled with random entries as ``policy`` would leave a ``context_length`` prompt.

  Returns (cache, budgets per layer). Each head holds the most recent
  positions: layer l's heads hold positions n - b_l .. n - 1 in slots
  0 .. b_l - 1 (b_l its budget, n the context length). Filled through the
  cache's own API (``create``, then ``reserve``, ``write`` and ``set_lengths``
  in one program that updates the pools in place).
  """
  from kvjax.cache.paged import PagedKVCache
  c = lm.config
  n = cfg.context_length
  budgets = cache_budgets(lm, cfg, policy)
  capacity = memory.cache_capacity(policy, budget=cfg.budget, prompt_len=n,
                                   new_tokens=new_tokens(cfg), page_size=cfg.page_size,
                                   num_layers=c.num_layers, num_kv_heads=c.num_kv_heads)
  cache = PagedKVCache.create(batch_size=cfg.batch_size, capacity=capacity,
                              num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                              head_dim=c.head_dim, page_size=cfg.page_size, dtype=lm.dtype)
  cache = _fill(cache, jnp.asarray(budgets, jnp.int32), n, max(budgets), jax.random.key(seed))
  return cache, budgets


@functools.partial(jax.jit, static_argnums=(2, 3), donate_argnums=0)
def _fill(cache, budgets, n: int, t: int, key):
  """Reserves pages for ``budgets`` [L] entries per head of each layer and writes the last
  ``t`` of ``n`` positions there, random keys and values.

  Token i (position n - t + i) goes to slot i - (t - b_l) of layer l (b_l <= t),
  skipped (slot -1) when negative.
  """
  b, kh, h = cache.batch_size, cache.num_kv_heads, cache.k_pages.shape[-1]
  cache = cache.reserve(jnp.broadcast_to(budgets[None, :, None], cache.lengths.shape))
  positions = jnp.broadcast_to(n - t + jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]

  def layer(l, cache):
    kk, kv = jax.random.split(jax.random.fold_in(key, l))
    k = jax.random.normal(kk, (b, t, kh, h), cache.k_pages.dtype)
    v = jax.random.normal(kv, (b, t, kh, h), cache.v_pages.dtype)
    slot = jnp.arange(t, dtype=jnp.int32) - (t - budgets[l])
    slots = jnp.broadcast_to(jnp.where(slot >= 0, slot, -1), (b, kh, t))  # [B, K, T]
    cache = cache.write(l, k, v, slots, positions)
    return cache.set_lengths(l, jnp.broadcast_to(budgets[l], (b, kh)))

  return jax.lax.fori_loop(0, cache.num_layers, layer, cache)


def synthetic_decode(lm, cfg: BenchConfig, policy) -> dict:
  """Times the decode loop on synthetic caches: the best of ``repeats`` runs after a warm-up.

  ``cfg.backend`` (possibly "auto", resolved per op) builds the decode program's
  execution (``kvjax.execution.create``). Returns decode_s, steps (forward passes timed),
  compile_s, kv_bytes, and prefill_s / prompt_tokens None.
  """
  from kvjax import generation
  best = compile_s = None
  for i in range(cfg.repeats + 1):  # run 0 is the warm-up (it compiles)
    cache, budgets = synthetic_cache(lm, cfg, policy, seed=i)
    kv_bytes = cache.kv_bytes
    jax.block_until_ready(cache)
    limit = jnp.broadcast_to(jnp.asarray(budgets, jnp.int32)[None, :, None], cache.lengths.shape)
    logits = jnp.zeros((cfg.batch_size, lm.config.vocab_size), jnp.float32)
    nxt = jnp.full((cfg.batch_size,), cfg.context_length, jnp.int32)
    _, steps, _, seconds, dt = generation.decode(
        lm, cache, logits, nxt, policy=policy, limit=limit, max_new_tokens=new_tokens(cfg),
        backend=cfg.backend)
    del cache
    if i == 0:
      compile_s = dt
    elif best is None or seconds < best[0]:
      best = (seconds, steps - 1)  # steps counts the first token too
  return {"prefill_s": None, "decode_s": best[0], "steps": best[1], "compile_s": compile_s,
          "kv_bytes": kv_bytes, "prompt_tokens": None}
