"""``python -m kvjax.eval``: see kvjax/eval/main.py."""

from kvjax.eval.main import run

run()
