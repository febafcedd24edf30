"""Generation on a small random model: cache path vs. full forward, batching, compiles."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import kvjax
from kvjax import generation as generate_lib
from kvjax import policies
from kvjax import testing
from kvjax.generation import compile as compile_lib

CONFIG = kvjax.LlamaConfig(
    vocab_size=97, hidden_size=64, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=256, tie_embeddings=False,
    rope_theta=500.0)


def _greedy_by_forward(lm, ids, n):
  """Reference: re-run the whole sequence through the uncached forward each step."""
  ids = list(ids)
  out = []
  for _ in range(n):
    token = int(jnp.argmax(lm.forward(np.array([ids]))[0, -1]))
    out.append(token)
    ids.append(token)
  return out


class GenerateTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.lm = kvjax.init_random(CONFIG, seed=3)
    rng = np.random.default_rng(0)
    cls.prompts = [rng.integers(0, 97, n).tolist() for n in (41, 7, 70)]

  def test_greedy_tokens_equal_uncached_forward(self):
    result = kvjax.generate(self.lm, self.prompts, max_new_tokens=12, stop_ids=[])
    for prompt, got in zip(self.prompts, result.token_ids):
      want = _greedy_by_forward(self.lm, prompt, 12)
      self.assertGreater(len(set(want)), 2)  # the model does not just repeat one token
      self.assertEqual(got, want)

  def test_batch_equals_one_at_a_time(self):
    batch = kvjax.generate(self.lm, self.prompts, max_new_tokens=10, stop_ids=[])
    for prompt, got in zip(self.prompts, batch.token_ids):
      alone = kvjax.generate(self.lm, [prompt], max_new_tokens=10, stop_ids=[])
      self.assertEqual(alone.token_ids[0], got)

  def test_batch_equals_one_at_a_time_under_policies(self):
    # Prefill compression (snapkv) and decode-time eviction by accumulated attention
    # (h2o): a sequence's tokens and kept entries do not depend on its batch mates.
    for policy in (policies.get("snapkv", window=8), policies.get("h2o", recent=8)):
      kw = dict(policy=policy, budget=24, max_new_tokens=10, stop_ids=[], pad_multiple=128)
      batch = kvjax.generate(self.lm, self.prompts, **kw)
      for i, prompt in enumerate(self.prompts):
        alone = kvjax.generate(self.lm, [prompt], **kw)
        self.assertEqual(alone.token_ids[0], batch.token_ids[i], policy.name)
        np.testing.assert_array_equal(alone.cache.kept_positions()[0],
                                      batch.cache.kept_positions()[i], err_msg=policy.name)

  def test_sampled_policy_run_is_deterministic_for_a_seed(self):
    kw = dict(policy=policies.get("h2o", recent=8), budget=24, max_new_tokens=10, stop_ids=[],
              pad_multiple=128, temperature=1.0, seed=7)
    a = kvjax.generate(self.lm, self.prompts, **kw)
    b = kvjax.generate(self.lm, self.prompts, **kw)
    self.assertEqual(a.token_ids, b.token_ids)
    for name in ("positions", "scores", "page_table", "lengths", "k_pages"):
      np.testing.assert_array_equal(getattr(a.cache, name), getattr(b.cache, name), err_msg=name)

  def test_question_appended_after_prefill_equals_one_prefill(self):
    # With the full cache, prefilling the context and then appending the question
    # (the query-agnostic path) must match prefilling both at once.
    rng = np.random.default_rng(4)
    questions = [rng.integers(0, 97, n).tolist() for n in (5, 19, 1)]
    kw = dict(questions=questions, max_new_tokens=8, stop_ids=[])
    aware = kvjax.generate(self.lm, self.prompts, query_aware=True, **kw)
    agnostic = kvjax.generate(self.lm, self.prompts, query_aware=False, **kw)
    self.assertEqual(aware.token_ids, agnostic.token_ids)
    self.assertEqual(agnostic.stats.prompt_tokens, (46, 26, 71))
    np.testing.assert_array_equal(np.sort(agnostic.cache.kept_positions()[1, 0, 0])[-26 - 7:],
                                  np.arange(26 + 7))

  def test_stops_at_stop_id(self):
    free = kvjax.generate(self.lm, self.prompts[:1], max_new_tokens=8, stop_ids=[])
    stop = free.token_ids[0][3]
    first = free.token_ids[0].index(stop)
    stopped = kvjax.generate(self.lm, self.prompts[:1], max_new_tokens=8, stop_ids=[stop])
    self.assertEqual(stopped.token_ids[0], free.token_ids[0][:first + 1])
    self.assertEqual(stopped.stats.decode_steps, first)

  def test_sampling_is_deterministic_for_a_seed(self):
    a = kvjax.generate(self.lm, self.prompts, max_new_tokens=8, temperature=1.0, seed=5,
                       stop_ids=[])
    b = kvjax.generate(self.lm, self.prompts, max_new_tokens=8, temperature=1.0, seed=5,
                       stop_ids=[])
    c = kvjax.generate(self.lm, self.prompts, max_new_tokens=8, temperature=1.0, seed=6,
                       stop_ids=[])
    self.assertEqual(a.token_ids, b.token_ids)
    self.assertNotEqual(a.token_ids, c.token_ids)

  def test_no_recompilation_across_64_steps_and_two_calls(self):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (30, 50)]
    others = [rng.integers(0, 97, n).tolist() for n in (12, 64)]  # same padded shape
    before = dict(generate_lib.COMPILE_COUNT)
    result = kvjax.generate(self.lm, prompts, max_new_tokens=65, stop_ids=[])
    self.assertEqual(result.stats.decode_steps, 64)
    # One prefill and one decode program; the 64 steps run inside the decode one.
    self.assertEqual(generate_lib.COMPILE_COUNT["prefill"], before["prefill"] + 1)
    self.assertEqual(generate_lib.COMPILE_COUNT["decode"], before["decode"] + 1)
    self.assertGreater(result.stats.compile_s, 0)
    before = dict(generate_lib.COMPILE_COUNT)
    with testing.count_compilations() as second:
      kvjax.generate(self.lm, others, max_new_tokens=65, stop_ids=[])
    self.assertEqual(second[0], 0)  # no XLA compilation at all, helpers included
    self.assertEqual(generate_lib.COMPILE_COUNT, before)

  def test_programs_compile_with_xla_defaults_unless_cpu_options_are_set(self):
    seen = []

    class Lowered:  # records the options each compile gets
      def compile(self, compiler_options=None):
        seen.append(compiler_options)

    compile_lib.compile_lowered(Lowered(), "decode")
    lean = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    options = {"*": {"xla_cpu_use_fusion_emitters": False, "xla_cpu_enable_fast_math": False},
               "decode": dict(lean, xla_cpu_enable_fast_math=True)}
    with mock.patch.dict(compile_lib.cpu_compiler_options, options):
      compile_lib.compile_lowered(Lowered(), "decode")
      compile_lib.compile_lowered(Lowered(), "prefill")
    if jax.default_backend() == "cpu":  # a program's own options win over "*"
      self.assertEqual(seen, [None, {"xla_cpu_use_fusion_emitters": False,
                                     "xla_cpu_enable_fast_math": True, **lean},
                              options["*"]])
    else:  # the options are XLA:CPU's
      self.assertEqual(seen, [None] * 3)

  def test_an_xla_without_a_cpu_option_compiles_with_its_defaults(self):
    lowered = jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(4))
    with mock.patch.dict(compile_lib.cpu_compiler_options, {"*": {"xla_no_such_option": True}}):
      program = compile_lib.compile_lowered(lowered, "decode")
    np.testing.assert_array_equal(program(jnp.ones(4)), [3.0] * 4)

  def test_stats(self):
    result = kvjax.generate(self.lm, self.prompts, max_new_tokens=5, stop_ids=[])
    s = result.stats
    self.assertEqual(s.prompt_tokens, (41, 7, 70))
    self.assertEqual(s.generated_tokens, (5, 5, 5))
    # 128 padded prompt + 5 new tokens -> 144 slots per head, float32 keys and values.
    self.assertEqual(s.kv_capacity, ((144,) * CONFIG.num_kv_heads,) * CONFIG.num_layers)
    self.assertEqual(s.kv_bytes, 2 * 3 * CONFIG.num_layers * 2 * 144 * 16 * 4)
    # No stop id: the first token comes from the prefill's logits, the other 4 from the loop.
    self.assertEqual(s.decode_steps, 4)
    self.assertEqual((s.policy, s.budget), ("full", None))
    self.assertEqual(s.backend, kvjax.backend.resolve("auto", "paged_attention"))
    self.assertGreater(s.prefill_s, 0)
    self.assertGreater(s.decode_s, 0)
    self.assertAlmostEqual(s.decode_tokens_per_s, 3 * 5 / s.decode_s)
    self.assertAlmostEqual(s.decode_ms_per_step, 1e3 * s.decode_s / 4)
    np.testing.assert_array_equal(result.cache.lengths[:, 0, 0], [41 + 4, 7 + 4, 70 + 4])

  def test_shared_prefill_equals_one_generate_per_run(self):
    # generate_each runs the prompt's forward once and stores each policy's
    # choice of the recorded q, k, v: the same tokens and kept entries as a
    # generate call per run, for prefill-only, decode-evicting and
    # per-layer-budget policies, query-aware and query-agnostic; H2O's two
    # budgets share its scores (``Policy.shares_scores``).
    runs = [("full", None), (policies.get("snapkv", window=8), 24),
            (policies.get("h2o", recent=8), 24), (policies.get("h2o", recent=8), 32),
            (policies.get("pyramidkv", window=8), 24),
            ("paged_eviction", 48)]
    questions = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for query_aware in (True, False):
      kw = dict(questions=questions, query_aware=query_aware, max_new_tokens=10, stop_ids=[])
      before = dict(generate_lib.COMPILE_COUNT)
      each = list(generate_lib.generate_each(self.lm, self.prompts, runs, **kw))
      self.assertLessEqual(generate_lib.COMPILE_COUNT["record"], before["record"] + 1)
      self.assertEqual(generate_lib.COMPILE_COUNT["prefill"], before["prefill"])
      self.assertLessEqual(generate_lib.COMPILE_COUNT["score"], before["score"] + 1)
      self.assertLen(each, len(runs))
      for (policy, budget), got in zip(runs, each):
        want = kvjax.generate(self.lm, self.prompts, policy=policy, budget=budget, **kw)
        name = f"{got.stats.policy} query_aware={query_aware}"
        self.assertEqual(got.stats.policy, policies.get(policy).name)
        self.assertEqual(got.token_ids, want.token_ids, name)
        np.testing.assert_array_equal(got.cache.kept_positions(), want.cache.kept_positions(),
                                      err_msg=name)
        # Each run counts the shared forward once, and its own compression.
        self.assertGreater(got.stats.shared_prefill_s, 0)
        self.assertGreater(got.stats.prefill_s, got.stats.shared_prefill_s)
        self.assertEqual(got.stats.shared_prefill_s, each[0].stats.shared_prefill_s)
        self.assertEqual(want.stats.shared_prefill_s, 0.0)

  def test_generate_each_checks_every_run_first(self):
    with self.assertRaisesRegex(ValueError, "runs is empty"):
      next(generate_lib.generate_each(self.lm, [[1]], []))
    before = dict(generate_lib.COMPILE_COUNT)
    with self.assertRaisesRegex(ValueError, "needs a budget"):
      next(generate_lib.generate_each(self.lm, [[1, 2]], [("full", None), ("snapkv", None)]))
    self.assertEqual(generate_lib.COMPILE_COUNT, before)  # nothing ran

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "exceeds the model's context of 256"):
      kvjax.generate(self.lm, [[1] * 250], max_new_tokens=10)
    with self.assertRaisesRegex(ValueError, "prompt 1 is empty"):
      kvjax.generate(self.lm, [[1], []])
    with self.assertRaisesRegex(ValueError, "outside \\[0, 97\\)"):
      kvjax.generate(self.lm, [[1, 97]])
    with self.assertRaisesRegex(ValueError, "unknown policy 'nope'"):
      kvjax.generate(self.lm, [[1]], policy="nope")
    with self.assertRaisesRegex(ValueError, "budget must be None"):
      kvjax.generate(self.lm, [[1]], budget=64)
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      kvjax.generate(self.lm, [[1]], backend="cuda")
    with self.assertRaisesRegex(ValueError, "max_new_tokens must be a positive int"):
      kvjax.generate(self.lm, [[1]], max_new_tokens=0)


if __name__ == "__main__":
  absltest.main()
