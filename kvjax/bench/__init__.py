"""Benchmarks: decode speed, prefill time and memory of policies against cache length.

``python -m kvjax.bench`` (or ``kvjax-bench``) runs it from the command line;
``measure`` runs one configuration from Python.
"""

from kvjax.bench.runner import BenchConfig
from kvjax.bench.runner import measure

__all__ = ["BenchConfig", "measure"]
