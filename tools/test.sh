#!/usr/bin/env bash
# The project's tests, one command on a fresh machine: cargo's tests, then the Python
# package built into a virtual environment (tools/python-env.sh) and its pytest suite,
# SmolLM2 included. Nothing is downloaded from a model hub (HF_HUB_OFFLINE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
venv=$(bash tools/python-env.sh)
# Scratch stores under target/ as cargo's tests keep them: O_DIRECT needs a disk file
# system, and /tmp may be tmpfs.
root=$PWD
cd python/tests
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::FutureWarning --basetemp "$root/target/pytest" .
