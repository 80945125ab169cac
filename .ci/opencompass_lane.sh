#!/usr/bin/env bash
# The OpenCompass lane: build the third venv .venv-opencompass (opencompass pins numpy < 2, datasets < 4,
# scikit-learn 1.5, which neither the main venv nor the vLLM venv can share) and run tests/opencompass in it.
# Idempotent: an existing venv with the same opencompass is reused (the harness itself is always reinstalled,
# editable, without dependencies). torch is torch 2.13.0+cpu from the local wheel folder (small); without
# torchvision, as in the vLLM lane (harness/engines/compat.py fills the holes). `bash .ci/opencompass_lane.sh venv` only
# builds the venv, `... test` only runs the tests (.ci/lib.sh, run_lane); the tests' vLLM route needs
# .venv-vllm built first. docs/opencompass.md. Shared steps: .ci/lib.sh.
LANE=opencompass-lane
VENV=.venv-opencompass
source "$(dirname "$0")/lib.sh"

OPENCOMPASS_VERSION=0.5.4

build_venv() {
    if ! has_version opencompass "$OPENCOMPASS_VERSION"; then
        step "creating $VENV with opencompass==$OPENCOMPASS_VERSION"
        new_venv
        # torch first, pinned to the small CPU build, so opencompass's dependencies do not pull a CUDA one;
        # pyarrow < 21: newer pyarrow needs numpy >= 2, which opencompass's numpy < 2 pin forbids
        quiet_pip install -q "torch==2.13.0" "opencompass==$OPENCOMPASS_VERSION" "pyarrow<21"
    fi
    remove_torchvision
    step "installing what the harness's HF path needs that opencompass does not bring"
    # (no triton, which the harness declares: the HF path on CPU does not import it; torch 2.13.0+cpu does not
    # bring it, as in the vLLM lane)
    quiet_pip install -q "hydra-core>=1.3.2" "omegaconf>=2.3" "wandb>=0.19" "pytest>=8" "transformers>=5.16"
}

check_env() {
    "$PY" - <<'PYEOF'
import importlib.metadata as m

import numpy
import pyarrow  # noqa: F401  (datasets imports it: a numpy-2-only pyarrow fails here, not mid-run)
import transformers
from opencompass.models.base import BaseModel  # noqa: F401

print("[opencompass-lane] " + ", ".join(f"{p} {m.version(p)}" for p in
                                        ("opencompass", "torch", "transformers", "numpy", "datasets", "pyarrow")))
PYEOF
}

run_lane build_venv check_env tests/opencompass
