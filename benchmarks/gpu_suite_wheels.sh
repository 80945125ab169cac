#!/usr/bin/env bash
# The wheels the GPU machine needs to run the whole test suite (README, "Test"). That machine has torch, triton,
# transformers, scipy, pytest and friends, but no Hydra, metric libraries, open_clip, wandb, Submitit or
# pytest-xdist, and no network. Two git-ignored folders, each small enough to travel with the work tree in one
# device call (64 MiB per call; the tree is ~24 MB):
#   .whl   ../shared/device/wheels.sh core metrics clip (Hydra, rouge-score, jieba, rapidfuzz, open_clip), ~26 MB
#   .whlw  wandb with everything it imports (opentelemetry included: the wheel script's `wandb` group misses it, and
#          wandb 0.31 does not import without it), hydra-submitit-launcher + submitit, pytest-xdist, ~25 MB
# Usage (project root):  bash benchmarks/gpu_suite_wheels.sh
# Then, on ONE warm device machine (first call alone, then the second, back to back):
#   carry [".whl"]   python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl
#   carry [".whlw"]  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whlw/*.whl &&
#                    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -p no:cacheprovider -n 14 --dist loadscope \
#                      --ignore=tests/vllm --ignore=tests/opencompass          # ~7 minutes on the H200
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/device/wheels.sh core metrics clip
out=.whlw
rm -rf "$out" && mkdir -p "$out"
grep -qx '/.whlw/' .git/info/exclude 2>/dev/null || echo '/.whlw/' >> .git/info/exclude
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$out" wandb submitit hydra-submitit-launcher pytest-xdist 2> >(grep -v 'is ignored' >&2 || true)
# what the GPU machine has already (its own pytest runs the suite) or .whl brings
for pkg in pytest pluggy iniconfig pygments hydra_core omegaconf antlr4; do rm -f "$out"/"$pkg"-*.whl; done
du -sh .whl "$out"
