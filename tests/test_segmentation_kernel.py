"""Segmentation kernels: the references on hand-worked values, both kernel forms (GPU and
TPU, in interpret mode) against them, and lowering for cuda and tpu at the shapes
generation produces."""

import contextlib
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kvjax.kernels import platform
from kvjax.kernels import segmentation as seg_lib
from kvjax.policies import dynsplit
from kvjax.policies import sablock


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


@contextlib.contextmanager
def _form(form):
  """Interpret mode running ``form``: the generic interpreter runs the GPU form, TPU
  interpret mode the TPU form."""
  ctx = pltpu.force_tpu_interpret_mode() if form == platform.TPU else contextlib.nullcontext()
  with ctx:
    assert platform.lowering(True) == form
    yield


def _ragged_lengths(t):
  """Full, cut mid-row (across a 1024-token TPU tile for t > 1024), empty, one token."""
  return jnp.asarray([t, t * 15 // 16, 0, 1], jnp.int32)


# (form, T, max_segment, min_segment). The TPU form under TPU interpret mode costs more,
# so it runs fewer cases.
_SEGMENT_CASES = [(platform.GPU, 40, 8, 1), (platform.GPU, 40, 5, 3), (platform.GPU, 40, 40, 2),
                  (platform.GPU, 40, 1, 1), (platform.GPU, 1100, 64, 4),
                  (platform.TPU, 1100, 64, 4), (platform.TPU, 1100, 2000, 2)]


@pytest.mark.parametrize("form,t,max_segment,min_segment", _SEGMENT_CASES)
def test_segment_ids_kernel_matches_reference(form, t, max_segment, min_segment):
  rng = np.random.default_rng(t + max_segment)
  cuts = jnp.asarray(rng.random((4, t)) < 0.2)
  lengths = _ragged_lengths(t)
  want = seg_lib.segment_ids_reference(cuts, lengths, max_segment=max_segment,
                                       min_segment=min_segment)
  with _form(form):
    got = seg_lib.segment_ids(cuts, lengths, max_segment=max_segment, min_segment=min_segment,
                              interpret=True)
  np.testing.assert_array_equal(got, want)


def _assert_blocks_tile(starts, sizes, lengths):
  """The blocks tile [0, length) exactly, in order."""
  starts, sizes = np.asarray(starts), np.asarray(sizes)
  for i, n in enumerate(np.asarray(lengths)):
    used = sizes[i] > 0
    assert sizes[i].sum() == n
    np.testing.assert_array_equal(starts[i][used],
                                  np.cumsum(np.concatenate([[0], sizes[i][used]]))[:-1])


# (form, T, chunk, delta, alpha): delta 0; alpha not a power of two; candidate windows
# across a TPU tile boundary (T 1100) and over three tiles (2D + 1 = 1201).
_SPLIT_CASES = [(platform.GPU, 50, 6, 2, 1.0), (platform.GPU, 50, 8, 0, 0.5),
                (platform.GPU, 50, 4, 3, 2.0), (platform.GPU, 1100, 40, 8, 0.3),
                (platform.GPU, 3000, 700, 600, 1.0),
                (platform.TPU, 50, 8, 0, 0.5), (platform.TPU, 1100, 40, 8, 0.3),
                (platform.TPU, 3000, 700, 600, 1.0)]


@pytest.mark.parametrize("form,t,chunk,delta,alpha", _SPLIT_CASES)
def test_dynamic_split_kernel_matches_reference(form, t, chunk, delta, alpha):
  rng = np.random.default_rng(t + chunk)
  density = jnp.asarray(rng.random((4, t)), jnp.float32)
  cand = jnp.asarray(rng.random((4, t)) < 0.3)
  lengths = _ragged_lengths(t).at[3].set(2)
  kwargs = dict(chunk=chunk, delta=delta, alpha=alpha)
  want = seg_lib.dynamic_split_reference(density, cand, lengths, **kwargs)
  with _form(form):
    got = seg_lib.dynamic_split(density, cand, lengths, interpret=True, **kwargs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  _assert_blocks_tile(*want, lengths)


@pytest.mark.parametrize("form", [platform.GPU, platform.TPU])
def test_dynamic_split_nan_density_matches_reference(form):
  # A NaN weight counts as the maximum (jnp.argmax): the first NaN candidate wins.
  density = np.random.default_rng(1).random((1, 40)).astype(np.float32)
  density[0, 17] = np.nan
  density = jnp.asarray(density)
  cand = jnp.ones((1, 40), bool)
  lengths = jnp.asarray([40], jnp.int32)
  kwargs = dict(chunk=6, delta=2, alpha=1.0)
  want = seg_lib.dynamic_split_reference(density, cand, lengths, **kwargs)
  with _form(form):
    got = seg_lib.dynamic_split(density, cand, lengths, interpret=True, **kwargs)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def _defaults(cls):
  return {f.name: f.default for f in dataclasses.fields(cls)}


# What generation produces: prompts right-padded to a multiple of 64 (a 2,047-token
# prompt -> 2048, 2,049 -> 2112), SmolLM2 (8K context) and Llama-3.2-1B (128K).
_LOWER_SHAPES = [(1, 64), (1, 2048), (4, 2048), (1, 2112), (3, 4160), (1, 4096), (4, 8192),
                 (1, 32768), (4, 32768), (1, 131072)]
_PLATFORMS = [("cuda", platform.GPU, "triton"), ("tpu", platform.TPU, "tpu_custom_call")]


def _lowered_text(fn, shapes, plat, form):
  with mock.patch.object(platform, "lowering", lambda interpret, target=None: form):
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=(plat,)).as_text()


@pytest.mark.parametrize("plat,form,marker", _PLATFORMS)
def test_lowers_at_generation_shapes(plat, form, marker):
  # Lowering only (no chip here): Triton's and Mosaic's lowering rules accept every op
  # at every shape, with the policies' own arguments (SentenceKV segments with
  # policies.selection, not this kernel).
  sab, dyn = _defaults(sablock.SABlock), _defaults(dynsplit.DynSplitKV)
  segment = lambda c, n: seg_lib.segment_ids.__wrapped__(
      c, n, max_segment=sab["max_segment"], min_segment=sab["min_segment"])
  split = lambda d, c, n: seg_lib.dynamic_split.__wrapped__(
      d, c, n, chunk=dyn["chunk"], delta=dyn["delta"], alpha=float(dyn["alpha"]))
  for b, t in _LOWER_SHAPES:
    bools = jax.ShapeDtypeStruct((b, t), jnp.bool_)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    density = jax.ShapeDtypeStruct((b, t), jnp.float32)
    assert marker in _lowered_text(segment, (bools, lengths), plat, form), (b, t)
    assert marker in _lowered_text(split, (density, bools, lengths), plat, form), (b, t)


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
