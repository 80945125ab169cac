#!/usr/bin/env bash
# What `vllm serve` (vLLM 0.26) imports beyond ../shared/device/vllm_stage.sh's parts, for the GPU machine (no
# network): vllm/entrypoints/openai/api_server.py imports the SageMaker router, which imports
# model_hosting_container_standards (needs jmespath; supervisor for its process manager). The offline LLM path
# imports none of them, which is why the stage script's own check (LLM with dummy weights) passes without them.
# Session 12 (2026-12-03) lost one serving call to that ImportError, then ran with these three wheels.
# Usage (project root):  bash benchmarks/vllm_serve_wheels.sh        -> .vllm/extra/ (git-ignored, ~0.5 MB)
# On the device, after .vllm/install/install.sh (same call as the last part, carry [".vllm/pN", ".vllm/install", ".vllm/extra"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .vllm/extra/*.whl
#   PYTHONPATH=/tmp/vsite python3 -c "import vllm.entrypoints.openai.api_server"     # the check that matters
set -euo pipefail
cd "$(dirname "$0")/.."
out=.vllm/extra
rm -rf "$out" && mkdir -p "$out"
grep -qx '/.vllm/' .git/info/exclude 2>/dev/null || echo '/.vllm/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$out" \
  "model-hosting-container-standards>=0.1.14,<1.0.0" jmespath supervisor 2> >(grep -v 'is ignored' >&2 || true)
ls "$out"
