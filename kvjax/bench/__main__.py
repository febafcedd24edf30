"""``python -m kvjax.bench``: see kvjax/bench/main.py."""

from kvjax.bench.main import run

run()
