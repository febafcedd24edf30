"""Segmentation kernels: the references on hand-worked values, the kernels against them."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kernels import segmentation as seg_lib


def _segment(cuts, length, max_segment, min_segment, t=None):
  t = t or len(cuts)
  row = np.zeros((1, t), bool)
  row[0, :len(cuts)] = cuts
  return seg_lib.segment_ids_reference(jnp.asarray(row), jnp.asarray([length], jnp.int32),
                                       max_segment=max_segment, min_segment=min_segment)


class TestSegmentIdsReference:

  def test_cuts_after_delimiters(self):
    # Delimiters after tokens 2 and 5; 8 valid tokens, 2 of padding.
    cuts = [0, 0, 1, 0, 0, 1, 0, 0, 0, 0]
    got = _segment(cuts, 8, max_segment=100, min_segment=1)
    np.testing.assert_array_equal(got[0], [0, 0, 0, 1, 1, 1, 2, 2, 3, 3])

  def test_max_segment_splits_long_runs(self):
    got = _segment([0] * 7, 7, max_segment=3, min_segment=1)
    np.testing.assert_array_equal(got[0], [0, 0, 0, 1, 1, 1, 2])

  def test_short_pieces_merge_into_the_next_segment(self):
    # Delimiters after tokens 0 and 4: the piece [0] is shorter than 2 and merges.
    got = _segment([1, 0, 0, 0, 1, 0, 0], 7, max_segment=100, min_segment=2)
    np.testing.assert_array_equal(got[0], [0, 0, 0, 0, 0, 1, 1])


class TestDynamicSplitReference:

  def test_boundary_weights_by_hand(self):
    # Density 1 on [0, 4), 0 after: C = 4, D = 1 from s = 0 -> ends 3, 4, 5; hi = 5.
    prefix = jnp.asarray(np.concatenate([[0.0], np.cumsum([1, 1, 1, 1, 0, 0, 0])]), jnp.float32)
    w = seg_lib.boundary_weights_reference(prefix, 0, chunk=4, delta=1, alpha=1.0)
    # e=3: 3/3 - (1+0)/2 = 0.5;  e=4: 4/4 - 0/1 = 1;  e=5: 4/5 - 0 = 0.8.
    np.testing.assert_allclose(w, [0.5, 1.0, 0.8], rtol=1e-6)

  def test_cuts_where_density_drops(self):
    # Dense tokens [0, 6), sparse after; every token is a candidate.
    density = np.zeros((1, 20), np.float32)
    density[0, :6] = 1.0
    cand = np.ones((1, 20), bool)
    starts, sizes = seg_lib.dynamic_split_reference(
        jnp.asarray(density), jnp.asarray(cand), jnp.asarray([20], jnp.int32),
        chunk=5, delta=2, alpha=1.0)
    assert int(starts[0, 0]) == 0 and int(sizes[0, 0]) == 6

  def test_falls_back_to_s_plus_c_without_candidates(self):
    density = np.random.default_rng(0).random((1, 20)).astype(np.float32)
    starts, sizes = seg_lib.dynamic_split_reference(
        jnp.asarray(density), jnp.zeros((1, 20), bool), jnp.asarray([20], jnp.int32),
        chunk=5, delta=2, alpha=1.0)
    # 0-5, 5-10, 10-15, then 5 tokens left (<= C + D): one last block.
    np.testing.assert_array_equal(starts[0, :4], [0, 5, 10, 15])
    np.testing.assert_array_equal(sizes[0], [5, 5, 5, 5] + [0] * (sizes.shape[1] - 4))
    assert (np.asarray(starts[0, 4:]) == 20).all()

  def test_only_candidates_are_chosen(self):
    density = np.ones((1, 16), np.float32)
    cand = np.zeros((1, 16), bool)
    cand[0, 5] = True  # only end 6 is allowed in [3, 7]
    starts, sizes = seg_lib.dynamic_split_reference(
        jnp.asarray(density), jnp.asarray(cand), jnp.asarray([16], jnp.int32),
        chunk=5, delta=2, alpha=1.0)
    assert int(sizes[0, 0]) == 6 and int(starts[0, 1]) == 6


def _random_segment_inputs(seed, b=3, t=40):
  rng = np.random.default_rng(seed)
  cuts = rng.random((b, t)) < 0.2
  lengths = np.array([t, t - 7, 1][:b], np.int32)
  return jnp.asarray(cuts), jnp.asarray(lengths)


@pytest.mark.parametrize("max_segment,min_segment", [(8, 1), (5, 3), (40, 2), (1, 1)])
def test_segment_ids_kernel_matches_reference(max_segment, min_segment):
  cuts, lengths = _random_segment_inputs(max_segment)
  want = seg_lib.segment_ids_reference(cuts, lengths, max_segment=max_segment,
                                       min_segment=min_segment)
  got = seg_lib.segment_ids(cuts, lengths, max_segment=max_segment, min_segment=min_segment,
                            interpret=True)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk,delta,alpha", [(6, 2, 1.0), (8, 0, 0.5), (4, 3, 2.0)])
def test_dynamic_split_kernel_matches_reference(chunk, delta, alpha):
  rng = np.random.default_rng(chunk)
  b, t = 3, 50
  density = jnp.asarray(rng.random((b, t)), jnp.float32)
  cand = jnp.asarray(rng.random((b, t)) < 0.3)
  lengths = jnp.asarray([50, 33, 2], jnp.int32)
  want = seg_lib.dynamic_split_reference(density, cand, lengths, chunk=chunk, delta=delta,
                                         alpha=alpha)
  got = seg_lib.dynamic_split(density, cand, lengths, chunk=chunk, delta=delta, alpha=alpha,
                              interpret=True)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  # The blocks tile [0, length) exactly.
  starts, sizes = map(np.asarray, want)
  for i, n in enumerate(np.asarray(lengths)):
    used = sizes[i] > 0
    assert sizes[i].sum() == n
    np.testing.assert_array_equal(starts[i][used], np.concatenate([[0], np.cumsum(sizes[i][used])[:-1]]))


def test_bad_inputs_raise():
  cuts = jnp.zeros((2, 8), bool)
  with pytest.raises(ValueError, match="lengths must have shape"):
    seg_lib.segment_ids(cuts, jnp.zeros((3,), jnp.int32), max_segment=4, min_segment=1)
  with pytest.raises(ValueError, match="min_segment 5 exceeds max_segment 4"):
    seg_lib.segment_ids(cuts, jnp.zeros((2,), jnp.int32), max_segment=4, min_segment=5)
  with pytest.raises(ValueError, match="density must have a dtype"):
    seg_lib.dynamic_split(jnp.zeros((2, 8), jnp.int32), cuts, jnp.zeros((2,), jnp.int32),
                          chunk=4, delta=1, alpha=1.0)
  with pytest.raises(ValueError, match=r"delta must be an int in \[0, chunk=4\)"):
    seg_lib.dynamic_split(jnp.zeros((2, 8)), cuts, jnp.zeros((2,), jnp.int32),
                          chunk=4, delta=4, alpha=1.0)
