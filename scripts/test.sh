#!/usr/bin/env bash
# Sets up .venv (with the test references) if needed, then runs the test suite
# without the few long end-to-end tests marked slow. Extra arguments go to
# pytest; a later -m replaces the default one, e.g. `bash scripts/test.sh -m slow`
# runs only those, `bash scripts/test.sh -m ""` everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -n 2 -m "not slow" tests "$@"
