#!/usr/bin/env bash
# The OpenCompass lane: build the third venv .venv-opencompass (opencompass pins numpy < 2, datasets < 4,
# scikit-learn 1.5, which neither the main venv nor the vLLM venv can share) and run tests/opencompass in it.
# Idempotent: an existing venv with the same opencompass is reused (the harness itself is always reinstalled,
# editable, without dependencies). torch is torch 2.13.0+cpu from the local wheel folder (small); without
# torchvision, as in the vLLM lane (harness/compat.py fills the holes). docs/opencompass.md.
set -euo pipefail
cd "$(dirname "$0")/.."

OPENCOMPASS_VERSION=0.5.4
VENV=.venv-opencompass
PY="$VENV/bin/python"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
t0=$SECONDS
step() { echo "[opencompass-lane] $1 ($((SECONDS - t0)) s)"; }
# pip on these machines warns about every missing local index folder: keep the log readable, keep the status.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if ! "$PY" -c "import importlib.metadata as m; assert m.version('opencompass') == '$OPENCOMPASS_VERSION'" 2>/dev/null; then
    step "creating $VENV with opencompass==$OPENCOMPASS_VERSION"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # torch first, pinned to the small CPU build, so opencompass's dependencies do not pull a CUDA one;
    # pyarrow < 21: newer pyarrow needs numpy >= 2, which opencompass's numpy < 2 pin forbids
    quiet_pip install -q "torch==2.13.0" "opencompass==$OPENCOMPASS_VERSION" "pyarrow<21"
fi
if "$PY" -c "import importlib.util as u, sys
sys.exit(0 if any(u.find_spec(p) for p in ('torchvision', 'torchaudio', 'torchcodec')) else 1)"; then
    step "removing torchvision/torchaudio/torchcodec (they do not load beside torch 2.13.0+cpu)"
    quiet_pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
step "installing the harness (editable, no deps) and what its HF path needs that opencompass does not bring"
quiet_pip install -q -e . --no-deps
# (pip then reports that the harness "requires triton": the HF path on CPU does not import it; torch 2.13.0+cpu
# does not bring it, as in the vLLM lane)
quiet_pip install -q "hydra-core>=1.3.2" "omegaconf>=2.3" "wandb>=0.19" "pytest>=8" "transformers>=5.16"

step "checking the environment"
"$PY" - <<'PYEOF'
import importlib.metadata as m

import numpy
import pyarrow  # noqa: F401  (datasets imports it: a numpy-2-only pyarrow fails here, not mid-run)
import transformers
from opencompass.models.base import BaseModel  # noqa: F401

print("[opencompass-lane] " + ", ".join(f"{p} {m.version(p)}" for p in
                                        ("opencompass", "torch", "transformers", "numpy", "datasets", "pyarrow")))
PYEOF
step "environment ready"

t_tests=$SECONDS
"$PY" -m pytest tests/opencompass -q -p no:cacheprovider
step "tests done in $((SECONDS - t_tests)) s; lane total"
