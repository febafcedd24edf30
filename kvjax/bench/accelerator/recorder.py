"""Rows: each written to results.jsonl as it is measured, with a progress line."""

from __future__ import annotations

import json
import pathlib
import time


def failure(e: BaseException) -> dict:
  """A failed measurement's fields: status "oom" or "error", and the message."""
  text = f"{type(e).__name__}: {e}"
  oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
  return {"status": "oom" if oom else "error", "error": " ".join(text.split())[:600]}


class Recorder:
  """Writes each row to results.jsonl as it comes and prints a progress line."""

  def __init__(self, out: pathlib.Path, context: dict):
    out.mkdir(parents=True, exist_ok=True)
    self.path = out / "results.jsonl"
    self.file = self.path.open("w")
    self.context = context
    self.rows: list[dict] = []
    self.notes: list[str] = []  # markdown lines for the end of summary.md
    self.start = time.perf_counter()

  def add(self, section: str, label: str, impl: str, **fields) -> dict:
    row = {"section": section, "label": label, "impl": impl, "status": "ok", "error": None,
           **fields, **self.context,
           "elapsed_s": round(time.perf_counter() - self.start, 2)}
    self.rows.append(row)
    self.file.write(json.dumps(row) + "\n")
    self.file.flush()
    print(f"[{row['elapsed_s']:7.1f}s] {section:<10} {label} | {impl} | {describe(row)}",
          flush=True)
    return row

  def close(self) -> None:
    self.file.close()


def fmt(x) -> str:
  if x is None:
    return "n/a"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def describe(row: dict) -> str:
  """A row's result in words: value and floor, or its failure."""
  if row["status"] != "ok":
    return f"{row['status'].upper()}: {row['error']}"
  if row["section"] == "equality":
    return ("equal" if row["equal"] else f"DIFFER from token {row['first_diff']}") + \
        f" ({row['tokens']} tokens)"
  return (f"{fmt(row['value'])} {row['unit']} (floor {fmt(row.get('floor'))}, "
          f"{fmt(row.get('of_floor'))} of it)")


def backend_label(name: str, op: str = "paged_attention") -> str:
  """A row's implementation: the backend's name; "auto (<what it runs for op>)" for auto."""
  from kvjax import backend
  return f"auto ({backend.resolve('auto', op)})" if name == "auto" else name


def policy_label(policy: str, budget: int | None) -> str:
  """"full cache" for no budget, else "<policy> @ <budget>"."""
  return "full cache" if budget is None else f"{policy} @ {budget}"
