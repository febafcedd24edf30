#!/usr/bin/env bash
# Sets up .venv (with the test references) if needed, then runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -n 2 tests "$@"
