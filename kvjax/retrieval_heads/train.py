"""Gate training of DuoAttention (arXiv 2410.10819): which KV heads need the whole context.

Every (layer, KV head) gets a gate g in [0, 1] that mixes two attentions of
that head's query group:

  out = g * full causal attention + (1 - g) * streaming attention

where streaming attention sees only the first ``n_sink`` keys and the
``recent`` most recent ones. The model's weights are frozen; only the gates
[L, K] (initialised to 1; a sliding-window model's global layers only) are
trained, with Adam, to keep the final hidden states at the answer positions
of passkey prompts (``kvjax.retrieval_heads.data``) where full attention
puts them, while an L1 term pulls every gate towards 0 (streaming). A head
whose gate stays high is a retrieval head: streaming attention there changes
what the model says. A head whose gate falls to 0 loses nothing by keeping
only sinks and recent tokens.

Dimension letters: B batch, T tokens, N query heads, K KV heads, G = N / K
query heads per KV head, H head dim, D model width, L layers.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kvjax import execution
from kvjax.cache.paged import layer_window
from kvjax.models.gemma3 import reference_attend
from kvjax.retrieval_heads import data as data_lib

# Defaults, sized so that SmolLM2-135M (30 layers, 3 KV heads) trains in a few
# minutes on a 2-core CPU: a step of 512 tokens took 4-6 s there
# (docs/results/retrieval_heads/README.md has the run).
STEPS = 80
LEARNING_RATE = 0.03  # Adam's; the paper's 0.02 is for 2000 steps
LENGTH = 512  # tokens per training prompt
BATCH_SIZE = 1
N_SINK = 4  # StreamingLLM's sinks (kvjax.policies.streaming_llm's default)
RECENT = 64
# Weight of mean(|gates|) in the loss. On SmolLM2 at 512 tokens, the squared
# error's gradient at gates 0.9 is ~1e-3 for most heads and 0.01-0.07 for a
# few: 0.1 / (L * K) = 1.1e-3 per gate pulls the many down, not the few.
L1 = 0.1
SEED = 0

# A data source: rng -> (tokens [B, T] int32, answer [B] int32 answer tokens
# at the end of each row, whose hidden states the loss compares).
DataFn = Callable[[np.random.Generator], tuple[np.ndarray, np.ndarray]]


# Training differentiates through the XLA references of every op.
REFERENCE = execution.Execution()

def streaming_mask(t: int, *, n_sink: int, recent: int) -> jax.Array:
  """[T, T] bool: query i sees key j when j <= i and (j < n_sink or i - j < recent).

  ``recent`` counts the query's own position: with recent=1 a query sees the
  sinks and itself.
  """
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  return (j <= i) & ((j < n_sink) | (i - j < recent))


def mixed_attention(q: jax.Array, k: jax.Array, v: jax.Array, gates_layer: jax.Array, *,
                    n_sink: int, recent: int, window: int | jax.Array = 0) -> jax.Array:
  """Each KV head's gate-weighted mix of full causal and streaming attention.

  Args:
    q: [B, T, N, H] queries; k, v: [B, T, K, H] keys and values (RoPE applied).
    gates_layer: [K] floats in [0, 1]; 1 is full attention, 0 streaming. A KV
      head's gate applies to its group of G = N / K query heads (heads
      n = k * G ... k * G + G - 1, as the model's grouped-query attention).
    n_sink, recent: the streaming side's keys (``streaming_mask``).
    window: the full side's keys are the last ``window`` (0: all, causal), as
      a sliding-window layer sees them; may be traced (a scanned layer's).

  Returns:
    [B, T, N, H] in q's dtype; scores and softmaxes in float32.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of the KV heads K={kh}")
  if gates_layer.shape != (kh,):
    raise ValueError(f"gates_layer must be [K]=({kh},), got shape {gates_layer.shape}")
  qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * h ** -0.5
  causal = jnp.tril(jnp.ones((t, t), bool))
  causal &= (window == 0) | (jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window)
  stream = streaming_mask(t, n_sink=n_sink, recent=recent)
  full_p = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  stream_p = jax.nn.softmax(jnp.where(stream, scores, -jnp.inf), axis=-1)
  # The mix is linear in the probabilities: one product with v serves both.
  g = gates_layer.astype(jnp.float32)[None, :, None, None, None]
  probs = g * full_p + (1.0 - g) * stream_p
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32))
  return out.reshape(b, t, n, h).astype(q.dtype)


def _hidden(graphdef, params, tokens, attend, state):
  """The model's final hidden states [B, T, D] (after the final norm) under ``attend``."""
  model = nnx.merge(graphdef, params)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  hidden, _ = model(tokens, positions, state, attend, REFERENCE)
  return hidden.astype(jnp.float32)


def answer_mask(answer: jax.Array, t: int) -> jax.Array:
  """answer [B] counts -> [B, T] float32, 1 on each row's last answer[b] positions."""
  return (jnp.arange(t)[None, :] >= t - answer[:, None]).astype(jnp.float32)


def gate_loss(gates, hidden_full, graphdef, params, tokens, answer, *, n_sink, recent, l1):
  """The paper's loss: (mixed - full)^2 on the answer positions, + l1 * mean(|gates|).

  Args:
    gates: [L', K], one row per global layer (``config.global_layers``); the model's
      sliding-window layers attend as they do in the model.
    hidden_full: [B, T, D] full attention's final hidden states;
    tokens: [B, T] int32; answer: [B] int32 (``answer_mask``).

  Returns:
    (loss, mse) scalars; mse is the mean over answer positions and D.
  """

  # Recomputed in the backward pass rather than kept: a layer's [B, N, T, T]
  # probabilities, kept for all L layers, cost more to write and read back
  # than to recompute (a step ran ~1.5x faster).
  mixed = jax.checkpoint(functools.partial(mixed_attention, n_sink=n_sink, recent=recent))
  windows = nnx.merge(graphdef, params).config.layer_windows
  rows = np.cumsum([not w for w in windows]) - 1  # a global layer's row of the gates

  def attend(state, layer, q, k, v):
    # A sliding-window layer attends over its window, ungated (gate 1).
    window, local = layer_window(windows, layer)
    gate = jnp.where(local, 1.0, state[jnp.asarray(rows)[layer]])
    return state, mixed(q, k, v, gate, window=jnp.where(local, window, 0))

  hidden = _hidden(graphdef, params, tokens, attend, gates)
  mask = answer_mask(answer, tokens.shape[1])
  squared = jnp.mean(jnp.square(hidden - hidden_full), axis=-1)  # [B, T]
  mse = jnp.sum(squared * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return mse + l1 * jnp.mean(jnp.abs(gates)), mse


def make_update(graphdef, optimizer: optax.GradientTransformation, *, n_sink: int,
                recent: int, l1: float):
  """The jitted training step: (params, gates, opt_state, tokens, answer) ->
  (gates, opt_state, loss, mse).

  The parameters are an argument (closed over, XLA would embed them in the
  program as constants) that is never differentiated: only the gates are.
  The full-attention reference runs in the same program, outside the
  gradient. Gates are clipped to [0, 1] after Adam's update.
  """

  @jax.jit
  def update(params, gates, opt_state, tokens, answer):
    # The model's own attention: causal, windowed on sliding-window layers.
    full_attend = reference_attend(nnx.merge(graphdef, params).config, REFERENCE)
    hidden_full = jax.lax.stop_gradient(_hidden(graphdef, params, tokens, full_attend, None))
    (loss, mse), grads = jax.value_and_grad(gate_loss, has_aux=True)(
        gates, hidden_full, graphdef, params, tokens, answer, n_sink=n_sink, recent=recent,
        l1=l1)
    updates, opt_state = optimizer.update(grads, opt_state, gates)
    gates = jnp.clip(optax.apply_updates(gates, updates), 0.0, 1.0)
    return gates, opt_state, loss, mse

  return update


def check_settings(*, steps, learning_rate, length, batch_size, n_sink, recent, l1,
                   seed=0) -> None:
  """Raises ValueError, quoting the value, for a setting ``train_gates`` cannot run with."""
  for name, value, low in (("steps", steps, 1), ("length", length, 1),
                           ("batch_size", batch_size, 1), ("n_sink", n_sink, 0),
                           ("recent", recent, 1), ("seed", seed, 0)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
      raise ValueError(f"{name} must be >= {low}, got {value}")
  for name, value in (("learning_rate", learning_rate), ("l1", l1)):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
      raise ValueError(f"{name} must be a number, got {value!r}")
    if not np.isfinite(value) or value < 0 or (name == "learning_rate" and value == 0):
      raise ValueError(f"{name} must be {'> 0' if name == 'learning_rate' else '>= 0'} and "
                       f"finite, got {value}")
  if length < n_sink + recent + 16:
    raise ValueError(f"length {length} is too short for n_sink={n_sink} + recent={recent}: "
                     f"it needs at least {n_sink + recent + 16} tokens so that the needle "
                     "can sit outside the streaming window")


def train_gates(lm, *, steps: int = STEPS, learning_rate: float = LEARNING_RATE,
                length: int = LENGTH, batch_size: int = BATCH_SIZE, n_sink: int = N_SINK,
                recent: int = RECENT, l1: float = L1, seed: int = SEED, progress: bool = True,
                data: DataFn | None = None,
                on_step: Callable[[int, float, float, float], None] | None = None
                ) -> tuple[np.ndarray, list[float]]:
  """Trains the DuoAttention gates of ``lm`` (a kvjax LanguageModel; its weights frozen).

  Args:
    steps: Adam steps, one batch each.
    learning_rate: Adam's rate.
    length: tokens per training prompt (T); at least n_sink + recent + 16 so
      that a needle can sit out of the streaming window.
    batch_size: prompts per step (B).
    n_sink, recent: the streaming attention the gates mix with full attention.
    l1: weight of mean(|gates|), the pull towards streaming.
    seed: seeds the prompts (``kvjax.retrieval_heads.data``).
    progress: a tqdm bar on stderr.
    data: rng -> (tokens [B, T], answer [B]); None: passkey prompts of
      ``length`` tokens in batches of ``batch_size`` from the model's
      tokenizer (token-id passkeys for a model without one).
    on_step: called after each step with (step, loss, its squared-error part,
      seconds since the start).

  Returns:
    (gates [L', K] float32 in [0, 1], one row per global layer (every layer
     but a sliding-window model's local ones), higher = more of a retrieval head;
     the loss of each step).

  Raises:
    ValueError: a bad argument (the value in the message), or a prompt
      longer than the model's context.
  """
  check_settings(steps=steps, learning_rate=learning_rate, length=length,
                 batch_size=batch_size, n_sink=n_sink, recent=recent, l1=l1, seed=seed)
  config = lm.config
  if length > config.max_position_embeddings:
    raise ValueError(f"length {length} exceeds the model's context of "
                     f"{config.max_position_embeddings}")
  if data is None:
    data = data_lib.batches(lm.tokenizer, length=length, batch_size=batch_size,
                            vocab_size=config.vocab_size)
  optimizer = optax.adam(learning_rate)
  gates = jnp.ones((len(config.global_layers), config.num_kv_heads), jnp.float32)
  opt_state = optimizer.init(gates)
  update = make_update(lm.graphdef, optimizer, n_sink=int(n_sink), recent=int(recent),
                       l1=float(l1))
  rng = np.random.default_rng([seed, 0x5EED])
  losses: list[float] = []
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  start = time.perf_counter()
  with tqdm(total=int(steps), desc="gates", unit="step", disable=not progress) as bar:
    for step in range(int(steps)):
      tokens, answer = data(rng)
      tokens, answer = _check_batch(tokens, answer, config, n_sink + recent)
      gates, opt_state, loss, mse = update(lm.params, gates, opt_state, tokens, answer)
      losses.append(float(loss))
      if on_step is not None:
        on_step(step, losses[-1], float(mse), time.perf_counter() - start)
      bar.set_postfix(loss=f"{losses[-1]:.4g}", mse=f"{float(mse):.3g}",
                      mean_gate=f"{float(jnp.mean(gates)):.2f}")
      bar.update()
  return np.asarray(gates, np.float32), losses


def _check_batch(tokens, answer, config, window: int):
  """A data source's batch as (tokens [B, T] int32, answer [B] int32) arrays, checked."""
  tokens = np.asarray(tokens)
  answer = np.asarray(answer)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"data must give int tokens [B, T], got {tokens.dtype} {tokens.shape}")
  b, t = tokens.shape
  if answer.shape != (b,) or not np.issubdtype(answer.dtype, np.integer):
    raise ValueError(f"data must give int answer counts [B]=({b},), got {answer.dtype} "
                     f"{answer.shape}")
  if t > config.max_position_embeddings:
    raise ValueError(f"{t} tokens exceed the model's context of "
                     f"{config.max_position_embeddings}")
  if tokens.min() < 0 or tokens.max() >= config.vocab_size:
    raise ValueError(f"token ids must be in [0, {config.vocab_size}), got "
                     f"[{tokens.min()}, {tokens.max()}]")
  if answer.min() < 1 or answer.max() > t - window:
    raise ValueError(f"answer counts must be in [1, {t - window}] (T={t} less the streaming "
                     f"window), got {answer.tolist()}")
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(answer, jnp.int32)
