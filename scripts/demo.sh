#!/usr/bin/env bash
# Sets up .venv if needed, then runs the default evaluation with SmolLM2-135M:
# needle-in-a-haystack at 2K tokens, full cache vs the policies at budget 128.
# Extra arguments are flags of `python -m kvjax.eval`, e.g. --lengths=4096.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m kvjax.eval "$@"
