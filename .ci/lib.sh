# Shared by the lane scripts (.ci/vllm_lane.sh, .ci/opencompass_lane.sh), which source it after setting
#   LANE  the log prefix ("vllm-lane", ...)
#   VENV  the lane's own venv folder, relative to the repository root
# Each lane lives in its own venv because its package pins torch/transformers/numpy differently from the
# main venv; what they all do alike is here. Recipe and pitfalls: shared/notes/environment.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${LANE:?set LANE before sourcing .ci/lib.sh}" "${VENV:?set VENV before sourcing .ci/lib.sh}"
PY="$VENV/bin/python"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
t0=$SECONDS
step() { echo "[$LANE] $1 ($((SECONDS - t0)) s)"; }
# pip on these machines warns about every missing local index folder: keep the log readable, keep the status.
quiet_pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# has_version DIST VERSION: the lane venv exists and holds DIST==VERSION (then it is reused as it is).
has_version() { "$PY" -c "import importlib.metadata as m; assert m.version('$1') == '$2'" 2>/dev/null; }

# new_venv: (re)create the lane venv, empty.
new_venv() { rm -rf "$VENV"; "$PYTHON" -m venv "$VENV"; }

# PyPI's torchvision/torchaudio/torchcodec do not load beside torch 2.13.0+cpu, and transformers imports
# them when present: remove them (harness/compat.py fills the holes their absence leaves).
remove_torchvision() {
    if "$PY" -c "import importlib.util as u, sys
sys.exit(0 if any(u.find_spec(p) for p in ('torchvision', 'torchaudio', 'torchcodec')) else 1)"; then
        step "removing torchvision/torchaudio/torchcodec (they do not load beside torch 2.13.0+cpu)"
        quiet_pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
}

# install_harness: the harness itself, always reinstalled (editable, no deps), so its entry points are current.
install_harness() { quiet_pip install -q -e . --no-deps; }

# run_tests PATH...: the lane's tests in its venv, timed.
run_tests() {
    local t_tests=$SECONDS
    "$PY" -m pytest "$@" -q -p no:cacheprovider
    step "tests done in $((SECONDS - t_tests)) s; lane total"
}
