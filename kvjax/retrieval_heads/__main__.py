"""``python -m kvjax.retrieval_heads``: see kvjax/retrieval_heads/main.py."""

from kvjax.retrieval_heads.main import run

run()
