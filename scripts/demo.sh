#!/usr/bin/env bash
# Sets up .venv if needed, then answers a long-context question with SmolLM2-135M.
# Extra arguments are flags of `python -m kvjax.main`, e.g. --context_tokens=4096.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m kvjax.main "$@"
