"""Evaluation: NIAH/RULER-style tasks and local datasets under KV-cache policies.

``python -m kvjax.eval`` (or ``kvjax-eval``) runs it from the command line;
``run`` and ``write_report`` are the same from Python.
"""

from kvjax.eval.metrics import METRICS
from kvjax.eval.metrics import score
from kvjax.eval.report import summary_markdown
from kvjax.eval.report import write_report
from kvjax.eval.runner import EvalConfig
from kvjax.eval.runner import run

__all__ = ["EvalConfig", "METRICS", "run", "score", "summary_markdown", "write_report"]
