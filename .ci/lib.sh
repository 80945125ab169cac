# Shared by the lane scripts (.ci/vllm_lane.sh, .ci/opencompass_lane.sh), which source it after setting
#   LANE  the log prefix ("vllm-lane", ...)
#   VENV  the lane's own venv folder, relative to the repository root
# and then call run_lane (below). Each lane lives in its own venv because its package pins torch/transformers/
# numpy differently from the main venv; what they all do alike is here. Recipe and pitfalls:
# shared/notes/environment.md.
#
# A lane script's argument says what to do: `venv` builds (or reuses) the venv and its pinned dependencies
# only — .ci/run does that in the background while the main venv is built; `test` installs the harness into it
# (editable, no deps), checks the environment and runs the lane's tests; none: both, in that order.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${LANE:?set LANE before sourcing .ci/lib.sh}" "${VENV:?set VENV before sourcing .ci/lib.sh}"
MODE=${1:-all}
case "$MODE" in venv|test|all) ;; *) echo "usage: $0 [venv|test]" >&2; exit 2 ;; esac
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
# them when present: remove them (harness/engines/compat.py fills the holes their absence leaves).
remove_torchvision() {
    if "$PY" -c "import importlib.util as u, sys
sys.exit(0 if any(u.find_spec(p) for p in ('torchvision', 'torchaudio', 'torchcodec')) else 1)"; then
        step "removing torchvision/torchaudio/torchcodec (they do not load beside torch 2.13.0+cpu)"
        quiet_pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
}

# install_harness: the harness itself, always reinstalled (editable, no deps), so its entry points are current.
# Editable installs write the checkout's egg-info: those of several venvs (.ci/run runs lanes at once) take
# turns on a lock of pyproject.toml (.ci/run's main-venv install takes it too).
install_harness() { (flock 9 && quiet_pip install -q -e . --no-deps) 9<pyproject.toml; }

# run_tests PATH...: the lane's tests in its venv, timed.
run_tests() {
    local t_tests=$SECONDS
    "$PY" -m pytest "$@" -q -p no:cacheprovider
    step "tests done in $((SECONDS - t_tests)) s; lane total"
}

# run_lane BUILD CHECK PATH...: what MODE asks for. BUILD (a function of the lane script) builds the venv with
# its pinned dependencies; the harness is installed after it (editable, no deps: its entry points are current,
# and no two venv builds write the checkout's egg-info at once), then CHECK (a function) and the tests in PATH.
run_lane() {
    local build=$1 check=$2
    shift 2
    if [ "$MODE" != test ]; then
        "$build"
        step "venv ready"
    fi
    if [ "$MODE" != venv ]; then
        [ -x "$PY" ] || { echo "[$LANE] $VENV does not exist: build it first ($0 venv)" >&2; return 1; }
        step "installing the harness (editable, no deps)"
        install_harness
        step "checking the environment"
        "$check"
        step "environment ready"
        run_tests "$@"
    fi
}
