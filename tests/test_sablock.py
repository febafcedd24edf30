"""SABlock: segments on real text, water-filled budgets, the block-size search, exactly B."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import execution
from kvjax import policies
from kvjax import testing
from kvjax.cache import Prompt
from kvjax.policies import selection

DELIM = 1  # the delimiter token of the hand-made prompts
EX = execution.Execution()


def _prompt(tokens, length=None):
  tokens = jnp.asarray(tokens, jnp.int32)[None]
  t = tokens.shape[1]
  return Prompt(tokens, jnp.arange(t, dtype=jnp.int32)[None],
                jnp.asarray([t if length is None else length], jnp.int32))


def test_segments_fall_on_punctuation_of_real_text(smollm2_lm):
  tok = smollm2_lm.tokenizer
  policy = policies.get("sablock", window=4, min_segment=1, max_segment=64).bind(tok)
  text = ("The cat sat on the mat, and the dog barked loudly at it. Then it rained; "
          "everyone left!\nA new line starts here: the end is near. 我喜欢猫。好的 and a few more words")
  ids = tok.encode(text)
  seg = np.asarray(policy.segments(EX, jnp.asarray([ids]), jnp.asarray([len(ids)])))[0]
  region = len(ids) - policy.window
  ends = [i for i in range(region - 1) if seg[i + 1] != seg[i]]
  ends_text = [tok.decode([ids[i]]) for i in ends]
  assert ends_text == [",", ".", ";", "!", "\n", ":", ".", "。"]
  # Every punctuation token of the region ends a segment.
  punct = [i for i in range(region - 1) if tok.decode([ids[i]]).strip(" ") in
           (",", ".", ";", "!", "\n", ":", "。")]
  assert ends == punct
  # min / max segment lengths are honoured.
  coarse = policies.get("sablock", window=4, min_segment=12, max_segment=16).bind(tok)
  seg = np.asarray(coarse.segments(EX, jnp.asarray([ids]), jnp.asarray([len(ids)])))[0][:region]
  counts = np.bincount(seg)
  assert counts.max() <= 16 and (counts[:-1] >= 12).all()


def _one_segment_inputs(peaks, seg_len=16, window=4, k=2):
  """One 16-token segment (delimiter at its end) + window; scores: 1 on `peaks`, 0.01 else."""
  t = seg_len + window
  tokens = np.full(t, 7)
  tokens[seg_len - 1] = DELIM
  scores = np.full((1, k, t), 0.01, np.float32)
  scores[0, :, peaks] = 1.0
  scores[0, :, seg_len:] = 2.0  # the window (always kept)
  return jnp.asarray(scores), _prompt(tokens)


def _plan(policy, scores, prompt, budget):
  return policy.plan(EX, scores, prompt, budget, budget)


def test_search_picks_single_tokens_under_a_tight_budget():
  policy = policies.get("sablock", window=4, kernel=1, delimiter_ids=(DELIM,), gamma=0.0,
                        min_segment=1, max_block=16)
  scores, prompt = _one_segment_inputs(peaks=[3, 11])
  plan = _plan(policy, scores, prompt, 4 + 2)
  t = scores.shape[-1]
  chex.assert_shape(plan.segments, (1, t))
  chex.assert_shape([plan.scores, plan.allocation, plan.block_size, plan.keep], (1, 2, t))
  assert int(plan.allocation[0, 0, 0]) == 2
  assert int(plan.block_size[0, 0, 0]) == 1
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert kept == [3, 11, 16, 17, 18, 19]


def test_search_picks_large_blocks_under_a_loose_budget():
  policy = policies.get("sablock", window=4, kernel=1, delimiter_ids=(DELIM,), gamma=0.0,
                        min_segment=1, max_block=16)
  scores, prompt = _one_segment_inputs(peaks=[3, 11])
  plan = _plan(policy, scores, prompt, 4 + 16)  # the whole segment fits
  assert int(plan.block_size[0, 0, 0]) == 16
  # A budget of 8 in the segment: blocks of 8 keep only one peak (R = 1.07 < 0.9 * 2.06),
  # blocks of 4 keep both peaks ([0, 4) and [8, 12)): b = 4.
  plan = _plan(policy, scores, prompt, 4 + 8)
  assert int(plan.block_size[0, 0, 0]) == 4
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert kept == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]


def _four_segment_inputs(k=2):
  """Segments A [0, 4), B [4, 12), C [12, 28), D [28, 36) and a 4-token window.

  Scores (kernel 1, gamma 0, so s' = s): A 0.9 each (mean 0.9); B 0.5 (mean 0.5);
  C 1.0 on [16, 20), 0.02 elsewhere (mean 0.265); D 0.2 on 28 and 29, 0.3 on
  33, 0.01 elsewhere (mean 0.094); the window 2.0.
  """
  tokens = np.full(40, 7)
  tokens[[3, 11, 27, 35]] = DELIM
  s = np.full(40, 0.02, np.float32)
  s[0:4], s[4:12], s[16:20] = 0.9, 0.5, 1.0
  s[28:36] = 0.01
  s[[28, 29]], s[33] = 0.2, 0.3
  s[36:] = 2.0
  return jnp.asarray(np.broadcast_to(s, (1, k, 40))), _prompt(tokens)


def _four_segment_policy():
  return policies.get("sablock", window=4, kernel=1, delimiter_ids=(DELIM,), gamma=0.0,
                      min_segment=1, max_block=16)


def test_whole_segments_first_then_blocks_of_the_partial_one_then_a_whole_block():
  scores, prompt = _four_segment_inputs()
  # Room 18 past the window: A (4) and B (8) whole, by mean; C (16) does not fit and
  # gets the 6 left. Its search: R(1) = 4.04 (the four 1.0s and two 0.02s); blocks
  # of 4 keep [16, 20): R = 4.0 >= 0.9 * 4.04, blocks of 8 keep none (6 // 8 = 0),
  # so b = 4 and 2 entries are left. They go as the best free block of 2, D's
  # [28, 30) (sum 0.4, against 0.31 for [32, 34)), not as the best two single
  # tokens (33 and 28).
  plan = _plan(_four_segment_policy(), scores, prompt, 4 + 18)
  seg_starts = [0, 4, 12, 28]
  segment_of = np.asarray(plan.segments[0])[seg_starts]
  np.testing.assert_array_equal(np.asarray(plan.allocation[0, 0])[segment_of], [4, 8, 6, 0])
  np.testing.assert_array_equal(np.asarray(plan.block_size[0, 0])[segment_of], [4, 8, 4, 0])
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert kept == list(range(12)) + [16, 17, 18, 19, 28, 29, 36, 37, 38, 39]
  np.testing.assert_array_equal(plan.single, [[0, 0]])
  np.testing.assert_array_equal(np.asarray(plan.keep).sum(-1), [[22, 22]])


def test_a_remainder_no_block_fits_is_one_token():
  scores, prompt = _four_segment_inputs()
  # Room 17: C gets 5, keeps one block of 4 (b = 4), and the 1 left is the best
  # free token, 33.
  plan = _plan(_four_segment_policy(), scores, prompt, 4 + 17)
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert kept == list(range(12)) + [16, 17, 18, 19, 33, 36, 37, 38, 39]
  np.testing.assert_array_equal(plan.single, [[1, 1]])


def test_a_segment_too_long_for_the_budget_is_searched_not_skipped():
  scores, prompt = _four_segment_inputs()
  # Room 3: A, the best by mean, does not fit whole, so it is the partial
  # segment; blocks of 2 would keep 1.8 < 0.9 * 2.7, so single tokens.
  plan = _plan(_four_segment_policy(), scores, prompt, 4 + 3)
  kept = np.nonzero(np.asarray(plan.keep[0, 0]))[0].tolist()
  assert kept == [0, 1, 2, 36, 37, 38, 39]
  assert int(plan.block_size[0, 0, int(plan.segments[0, 0])]) == 1
  np.testing.assert_array_equal(plan.single, [[3, 3]])


def _random_inputs(seed, t=96, kh=2, g=3, h=8):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(1, t, kh * g, h)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, t, kh, h)), jnp.float32)
  tokens = rng.integers(2, 50, size=t)
  tokens[rng.random(t) < 0.15] = DELIM
  return q, k, _prompt(tokens)


@pytest.mark.parametrize("budget", [12, 40, 90])
def test_exactly_the_budget_per_head_and_one_compile_per_budget(budget):
  policy = policies.get("sablock", window=8, delimiter_ids=(DELIM,))
  layout = testing.layout_for(policy, budget, 96)
  select = jax.jit(lambda q, k, prompt: policy.select(EX, layout)(0, prompt, q, k, k)[0])
  inputs = [_random_inputs(seed) for seed in range(2)]
  with testing.count_compilations() as n:
    outs = [select(*x) for x in inputs]
  assert n[0] == 1
  for slots in map(np.asarray, outs):
    np.testing.assert_array_equal((slots >= 0).sum(-1), budget)
    assert (slots[..., -8:] >= 0).all()  # the window is always kept


def test_needs_delimiters_and_checks_fields():
  q, k, prompt = _random_inputs(0)
  with pytest.raises(ValueError, match="needs delimiter_ids"):
    sablock = policies.get("sablock")
    sablock.select(EX, testing.layout_for(sablock, 20, 96))(0, prompt, q, k, k)
  with pytest.raises(ValueError, match="min_segment 8 exceeds max_segment 4"):
    policies.get("sablock", min_segment=8, max_segment=4)
  with pytest.raises(ValueError, match=r"epsilon must be a finite number in \[0, 1\)"):
    policies.get("sablock", epsilon=1.0)
  with pytest.raises(ValueError, match="delimiter_ids must be a sequence"):
    policies.get("sablock", delimiter_ids="abc")


def test_rank_in_segment_equals_brute_force():
  # The shift-and-count rank against counting every pair: segments from the
  # reference segmenter (at most max_segment long), means with many ties,
  # every block size, a ragged batch.
  from kvjax.kernels import segmentation
  from kvjax.policies import sablock
  rng = np.random.default_rng(0)
  b, kh, t, span = 2, 3, 300, 64
  lengths = np.array([283, 150])
  seg = segmentation.segment_ids_reference(jnp.asarray(rng.random((b, t)) < 0.08),
                                           jnp.asarray(lengths), max_segment=span, min_segment=4)
  seg_np = np.asarray(seg)
  start = np.asarray(selection.segment_starts(seg))
  mean = rng.integers(0, 4, (b, kh, t)).astype(np.float32)
  for stride in (1, 2, 4, 8, 16, 32, 64):
    is_rep = (np.arange(t)[None] == start + (np.arange(t)[None] - start) // stride * stride)
    is_rep &= np.arange(t)[None] < lengths[:, None]
    got = np.asarray(sablock._rank_in_segment(jnp.asarray(mean), jnp.asarray(is_rep), seg,
                                              stride=stride, span=span))
    checked = 0
    for i_b in range(b):
      reps = np.flatnonzero(is_rep[i_b])
      for k in range(kh):
        for i in reps:
          same = reps[seg_np[i_b, reps] == seg_np[i_b, i]]
          m = mean[i_b, k]
          want = np.sum((m[same] > m[i]) | ((m[same] == m[i]) & (same < i)))
          assert got[i_b, k, i] == want, (stride, i_b, k, i)
          checked += 1
    assert checked > 0
