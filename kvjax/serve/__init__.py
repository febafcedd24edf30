"""Serving: many requests over one page pool (``Engine``), where evicted pages admit more."""

from kvjax.serve.engine import Engine
from kvjax.serve.requests import Completion
from kvjax.serve.requests import Request
from kvjax.serve.requests import parse_bytes

__all__ = ["Completion", "Engine", "Request", "parse_bytes"]
