#!/usr/bin/env bash
# CPU CI: install the pinned CPU torch, the package with its dev extras, lint, then the README's
# test command. Run from the repository root.
set -euo pipefail
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q -r ci/requirements-cpu.txt
python -m pip install -q -e '.[dev,ring-attention-pytorch]'
ruff check .
# The README's test command:
python -m pytest -n 2
