"""SmolLM2 in kvjax against transformers on the same GGUF (float32, eager attention).

Both models get the same token ids (ours), so only the forward passes are compared.
"""

import numpy as np
import pytest
import torch

import kvjax
from kvjax import tasks

TEXTS = [
    # Prose, code and a needle prompt, each well over 200 tokens.
    " ".join([
        "The history of the printing press begins in the fifteenth century, when movable type",
        "changed how knowledge travelled across Europe. Printers in Mainz, Venice and Paris",
        "competed for scholars, merchants and churches as customers; within fifty years books",
        "had become cheaper by an order of magnitude, and literacy rose in the cities first.",
    ] * 4) + " Summarise the paragraph above in one sentence.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n" * 6 + "# Explain what the functions above compute and how fast.\n",
]


@pytest.fixture(scope="module")
def prompts(smollm2_lm):
  tok = smollm2_lm.tokenizer
  passkey = tasks.passkey_prompt(tok, context_tokens=300, depth=0.4, seed=1).prompt
  ids = [tok.encode(tok.chatml([{"role": "user", "content": t}])) for t in TEXTS]
  ids.append(tok.encode(passkey))
  assert all(len(x) >= 200 for x in ids), [len(x) for x in ids]
  return ids


def test_logits_match_transformers(smollm2_lm, smollm2_hf, prompts):
  for ids in prompts:
    ours = np.asarray(smollm2_lm.forward(np.array([ids])))[0]
    with torch.no_grad():
      theirs = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)


def _hf_greedy(model, ids, n):
  """transformers' cached greedy decoding, never stopping early (no EOS check)."""
  tokens = []
  with torch.no_grad():
    out = model(torch.tensor([ids]), use_cache=True)
    for _ in range(n):
      token = int(out.logits[0, -1].argmax())
      tokens.append(token)
      out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
  return tokens


def test_greedy_continuation_matches_transformers(smollm2_lm, smollm2_hf, prompts):
  ours = kvjax.generate(smollm2_lm, prompts, max_new_tokens=32, stop_ids=[])
  for ids, got in zip(prompts, ours.token_ids):
    assert len(got) == 32
    assert got == _hf_greedy(smollm2_hf, ids, 32)


@pytest.mark.slow  # about 28 s; greedy parity of one sequence stays
def test_batch_of_three_equals_each_alone(smollm2_lm):
  tok = smollm2_lm.tokenizer
  prompts = [
      tok.chatml([{"role": "user", "content": "What is the capital of France?"}]),
      tasks.passkey_prompt(tok, context_tokens=400, depth=0.2, seed=2).prompt,
      tok.chatml([{"role": "user", "content": TEXTS[0]}]),
  ]
  batch = kvjax.generate(smollm2_lm, prompts, max_new_tokens=32)
  assert len(set(batch.stats.prompt_tokens)) == 3
  for prompt, got in zip(prompts, batch.token_ids):
    alone = kvjax.generate(smollm2_lm, [prompt], max_new_tokens=32)
    assert alone.token_ids[0] == got
  assert "Paris" in batch.texts[0]
