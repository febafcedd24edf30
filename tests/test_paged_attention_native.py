"""The C++ paged decode attention (kvjax.kernels.native) against the float32 reference,
its build cache and failures, and backend "native" in generation."""

import os
import pathlib
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import backend as backend_lib
from kvjax.kernels import native
from kvjax.kernels.paged_attention import paged_attention_reference


def setUpModule():
  # Needs a C++ compiler (the test machines have g++): a missing one is a failure here.
  if not backend_lib.native_available():
    raise AssertionError(f"native kernels unavailable: {backend_lib._native_error()}")


def _inputs(seed, *, b, kv, g, h, page, pool, max_pages, scale=1.0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, kv * g, h)).astype(np.float32)
  k_pages = (scale * rng.standard_normal((pool, page, h))).astype(np.float32)
  v_pages = rng.standard_normal((pool, page, h)).astype(np.float32)
  table = rng.integers(0, pool, (b, kv, max_pages)).astype(np.int32)
  lengths = rng.integers(0, max_pages * page + 1, (b, kv)).astype(np.int32)
  return q, k_pages, v_pages, table, lengths


def _native(*args, **kwargs):
  return jax.jit(native.paged_attention_cpu, static_argnames="return_weights")(*args, **kwargs)


def _dense_float64(q, k_pages, v_pages, table, lengths):
  """Softmax attention of each query head over its KV head's slots, in float64 numpy."""
  b, n, h = q.shape
  kv, page = table.shape[1], k_pages.shape[1]
  out = np.zeros((b, n, h))
  for i in range(b):
    for j in range(n):
      head = j // (n // kv)
      slots = [(max(table[i, head, s // page], 0), s % page) for s in range(lengths[i, head])]
      if not slots:
        continue
      keys = np.array([k_pages[p, o] for p, o in slots], np.float64)
      values = np.array([v_pages[p, o] for p, o in slots], np.float64)
      logits = keys @ q[i, j].astype(np.float64) / np.sqrt(h)
      w = np.exp(logits - logits.max())
      out[i, j] = w @ values / w.sum()
  return out


class NativeKernelTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("smollm2_like", dict(b=2, kv=3, g=3, h=64, page=16, pool=40, max_pages=8)),
      ("one_head", dict(b=2, kv=1, g=1, h=32, page=4, pool=5, max_pages=3)),
      ("wide_groups", dict(b=3, kv=2, g=16, h=128, page=8, pool=30, max_pages=6)),
      ("page_of_one", dict(b=2, kv=2, g=2, h=16, page=1, pool=50, max_pages=20)),
      # Long heads are cut into parts that the threads share, then merged.
      ("long_heads", dict(b=2, kv=1, g=4, h=64, page=16, pool=140, max_pages=64)),
  )
  def test_matches_reference_and_float64(self, shape):
    q, k_pages, v_pages, table, lengths = _inputs(0, **shape)
    lengths[0, 0] = 0  # an empty head outputs zeros
    lengths[-1, -1] = table.shape[-1] * k_pages.shape[1]  # a full one, with an absent
    table[-1, -1, -1] = -1  # page inside its length: it reads page 0, as the reference
    got = np.asarray(_native(q, k_pages, v_pages, table, lengths))
    want = np.asarray(paged_attention_reference(q, k_pages, v_pages, table, lengths))
    np.testing.assert_allclose(got, want, atol=3e-6, rtol=1e-5)
    np.testing.assert_allclose(got, _dense_float64(q, k_pages, v_pages, table, lengths),
                               atol=3e-6, rtol=1e-5)
    g = shape["g"]
    np.testing.assert_array_equal(got[0, :g], 0.0)

  def test_peaked_softmax(self):
    # Logits spread over hundreds: most weights underflow, one slot dominates.
    q, k_pages, v_pages, table, lengths = _inputs(1, b=2, kv=2, g=4, h=64, page=8, pool=20,
                                                  max_pages=4, scale=40.0)
    got = np.asarray(_native(q, k_pages, v_pages, table, lengths))
    np.testing.assert_allclose(got, _dense_float64(q, k_pages, v_pages, table, lengths),
                               atol=1e-5, rtol=1e-5)

  def test_unread_slots_and_pages_do_not_leak(self):
    # NaN and Inf past each head's length and in pages no head owns change nothing.
    q, k_pages, v_pages, table, lengths = _inputs(2, b=2, kv=2, g=3, h=32, page=4, pool=12,
                                                  max_pages=3)
    table = np.arange(12, dtype=np.int32).reshape(2, 2, 3)  # every head owns its pages
    lengths = np.array([[5, 0], [12, 9]], np.int32)
    clean = np.asarray(_native(q, k_pages, v_pages, table, lengths))
    poisoned_k, poisoned_v = k_pages.copy(), v_pages.copy()
    for i in range(2):
      for j in range(2):
        for s in range(lengths[i, j], 12):
          page, offset = table[i, j, s // 4], s % 4
          poisoned_k[page, offset] = np.nan
          poisoned_v[page, offset] = np.inf
    got = np.asarray(_native(q, poisoned_k, poisoned_v, table, lengths))
    np.testing.assert_array_equal(got, clean)

  def test_out_of_range_lengths_and_pages_are_clamped(self):
    # As the reference's gather: a length past capacity reads the capacity, a page id
    # past the pool reads the last page; nothing is read out of bounds.
    q, k_pages, v_pages, table, _ = _inputs(3, b=1, kv=2, g=2, h=16, page=4, pool=6,
                                            max_pages=2)
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)  # jax's gather clamps
    table[0, 1, 1] = 99
    lengths = np.array([[100, -3]], np.int32)
    got = np.asarray(_native(q, k_pages, v_pages, table, lengths))
    want = paged_attention_reference(q, k_pages, v_pages, table, np.array([[8, 0]], np.int32))
    np.testing.assert_allclose(got, want, atol=2e-6)
    clamped = table.copy()
    clamped[0, 1, 1] = 5
    np.testing.assert_allclose(
        np.asarray(_native(q, k_pages, v_pages, table, np.array([[3, 8]], np.int32))),
        paged_attention_reference(q, k_pages, v_pages, clamped, np.array([[3, 8]], np.int32)),
        atol=2e-6)

  def test_weights_and_other_dtypes_run_the_reference(self):
    args = _inputs(4, b=2, kv=2, g=2, h=16, page=4, pool=10, max_pages=3)
    got = _native(*args, return_weights=True)
    want = paged_attention_reference(*args, return_weights=True)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, atol=1e-6)
    q, k_pages, v_pages, table, lengths = args
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k_pages, v_pages)]
    np.testing.assert_array_equal(
        np.asarray(_native(*bf16, table, lengths), np.float32),
        np.asarray(jax.jit(paged_attention_reference)(*bf16, table, lengths), np.float32))

  def test_vmap(self):
    stacked = [np.stack(x) for x in zip(*(
        _inputs(s, b=2, kv=2, g=2, h=16, page=4, pool=10, max_pages=3) for s in (5, 6)))]
    got = jax.vmap(native.paged_attention_cpu)(*stacked)
    want = jax.vmap(paged_attention_reference)(*stacked)
    np.testing.assert_allclose(got, want, atol=2e-6)

  def test_bad_shapes_raise(self):
    q, k_pages, v_pages, table, lengths = _inputs(7, b=2, kv=2, g=2, h=16, page=4, pool=10,
                                                  max_pages=3)
    with self.assertRaisesRegex(Exception, "inconsistent shapes"):
      _native(q, k_pages, v_pages, table, lengths[:1]).block_until_ready()


class BuildTest(absltest.TestCase):

  def _tempdir(self) -> pathlib.Path:
    return pathlib.Path(self.enterContext(tempfile.TemporaryDirectory()))

  def test_build_is_cached_by_key_and_a_changed_header_builds_afresh(self):
    root = self._tempdir()
    first = native.build(root / "build")
    mtime = first.stat().st_mtime_ns
    self.assertEqual(native.build(root / "build"), first)  # found, not rebuilt
    self.assertEqual(first.stat().st_mtime_ns, mtime)
    self.assertEqual([p.name for p in first.parent.iterdir()], [first.name])  # no temp left
    # The key covers the headers the sources include (and the sources themselves).
    src = root / "src"
    src.mkdir()
    for f in native.SOURCES + native.HEADERS:
      changed = "\n// changed\n" if f == native.HEADERS[0] else ""
      (src / f.name).write_text(f.read_text() + changed)
    with mock.patch.multiple(native, SOURCES=tuple(src / f.name for f in native.SOURCES),
                             HEADERS=tuple(src / f.name for f in native.HEADERS)):
      second = native.build(root / "build")
    self.assertNotEqual(first.parent, second.parent)
    self.assertTrue(first.exists() and second.exists())

  def test_compiler_failures_raise_native_unavailable(self):
    root = self._tempdir()
    with mock.patch.dict(os.environ, {"CXX": "/bin/false"}):
      with self.assertRaisesRegex(native.NativeUnavailable, "failed"):
        native.build(root)
    with mock.patch.dict(os.environ, {"CXX": "/no/such/compiler"}):
      with self.assertRaisesRegex(native.NativeUnavailable, "does not run"):
        native.build(root)
    with mock.patch.dict(os.environ, {"CXX": ""}), \
        mock.patch.object(native.shutil, "which", return_value=None):
      with self.assertRaisesRegex(native.NativeUnavailable, "no C\\+\\+ compiler"):
        native.build(root)


class BackendTest(absltest.TestCase):

  def test_auto_is_native_on_cpu_unless_turned_off(self):
    self.assertEqual(backend_lib.resolve("auto"), "native")
    with mock.patch.dict(os.environ, {backend_lib.NATIVE_ENV: "0"}):
      self.assertEqual(backend_lib.resolve("auto"), "xla")
    # Ops without a native implementation run XLA under "native" and "auto".
    self.assertEqual(backend_lib.resolve("native", "window_scores"), "xla")
    self.assertEqual(backend_lib.resolve("auto", "compact_slots"), "xla")
    self.assertIs(backend_lib.get("paged_attention", "native"), native.paged_attention_cpu)

  def test_unavailable_native_falls_back_under_auto_and_raises_when_forced(self):
    with mock.patch.object(backend_lib, "_native_error", return_value="no compiler"):
      with self.assertWarnsRegex(UserWarning, "native CPU kernels unavailable.*no compiler"):
        self.assertEqual(backend_lib.resolve("auto"), "xla")
      with self.assertRaisesRegex(native.NativeUnavailable, "no compiler"):
        backend_lib.resolve("native")


class GenerateTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.lm = kvjax.init_random(kvjax.LlamaConfig(
        vocab_size=97, hidden_size=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, tie_embeddings=False,
        rope_theta=500.0), seed=3)
    rng = np.random.default_rng(0)
    cls.prompts = [rng.integers(0, 97, n).tolist() for n in (41, 7, 70)]

  def test_same_tokens_and_cache_as_xla(self):
    for policy, budget in (("full", None), ("snapkv", 80), ("h2o", 48)):
      kwargs = dict(max_new_tokens=8, stop_ids=[], policy=policy, budget=budget)
      xla = kvjax.generate(self.lm, self.prompts, backend="xla", **kwargs)
      got = kvjax.generate(self.lm, self.prompts, backend="native", **kwargs)
      self.assertEqual(got.stats.backend, "native")
      self.assertEqual(got.token_ids, xla.token_ids, policy)
      np.testing.assert_array_equal(got.cache.positions, xla.cache.positions)


if __name__ == "__main__":
  absltest.main()
