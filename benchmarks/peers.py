"""The peers the comparison scripts run beside kvjax: transformers, and kvpress's presses.

Imports nothing heavy at module level (a kvpress-only child process must not
load JAX); torch, transformers and kvpress are imported where used.
"""

import os
import pathlib

# kvjax policy -> kvpress press factory (kvpress module, compression ratio, window).
PRESSES = {
    "streaming_llm": lambda kp, cr, w: kp.StreamingLLMPress(compression_ratio=cr, n_sink=4),
    "snapkv": lambda kp, cr, w: kp.SnapKVPress(compression_ratio=cr, window_size=w),
    "pyramidkv": lambda kp, cr, w: kp.PyramidKVPress(compression_ratio=cr, window_size=w),
    "knorm": lambda kp, cr, w: kp.KnormPress(compression_ratio=cr),
    "chunkkv": lambda kp, cr, w: kp.ChunkKVPress(
        press=kp.SnapKVPress(compression_ratio=cr, window_size=w), chunk_length=20),
}


def press(policy: str, budget: int, num_tokens: int, window: int):
  """kvpress's press for a kvjax policy that keeps exactly ``budget`` of ``num_tokens``.

  kvpress keeps int(n * (1 - ratio)) entries; the extra half entry makes that exact.
  """
  import kvpress
  return PRESSES[policy](kvpress, 1.0 - (budget + 0.5) / num_tokens, window)


def load_transformers(gguf_path):
  """The GGUF loaded by transformers, offline: float32, SDPA attention, eval mode."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  import torch
  import transformers
  path = pathlib.Path(gguf_path)
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa",
      local_files_only=True).eval()
