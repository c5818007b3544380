#!/usr/bin/env bash
# Wheels of the pinned third-party libraries that the GPU host lacks (DeepSpeed, transformers and their
# requirements, from ci/requirements-thirdparty.txt), for the GPU host's Python, into gpu-deps/ (git-ignored).
# The GPU host has no network: the device tool carries gpu-deps/ there, and the run unpacks the wheels onto
# PYTHONPATH (docs/gpu.md "DeepSpeed on the GPU"). ring-flash-attn and yunchang are left out: on a GPU they need a
# real flash-attn. Usage: scripts/gpu_deps.sh [PYTHON_VERSION] (default 3.12, the lent hosts' Python).
set -euo pipefail
py="${1:-3.12}"
out=gpu-deps
rm -rf "$out" && mkdir -p "$out"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
grep -vE '^(#|ring-flash-attn|yunchang|deepspeed|ninja)' ci/requirements-thirdparty.txt >"$reqs"
for pkg in einops packaging; do  # DeepSpeed's requirements the CI image has, the GPU host may not
  echo "$pkg==$(python -c "import importlib.metadata as m; print(m.version('$pkg'))")" >>"$reqs"
done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 -d "$out" -r "$reqs"
# DeepSpeed is an sdist: a pure-Python wheel with no op compiled (its ops are never loaded by the adapters)
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$out" \
  "$(grep -E '^deepspeed==' ci/requirements-thirdparty.txt)"
du -sh "$out"
