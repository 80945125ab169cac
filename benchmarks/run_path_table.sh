#!/usr/bin/env bash
# The issue-17 table from the harness's own run path (python -m harness -> engine -> summary.json) on one GPU,
# beside the benchmark scripts' figures for the same shapes and a per-step time breakdown.
#
#   bash benchmarks/run_path_table.sh            # H200: ~6-8 min; writes results/benchmarks/run_path.{json,md}
#   bash benchmarks/run_path_table.sh --smoke    # CPU: the same four stages on the tiny shapes presets (~5 min)
#   RUN_PATHS=compiled T1_S=150 bash benchmarks/run_path_table.sh   # H200: the default decode path only (~5 min)
#   STAGES=tpot RUN_PATHS=compiled bash benchmarks/run_path_table.sh  # re-run stage 1 only (other stages' files kept)
#
# Stages (each under its own timeout; a failed stage is recorded, the others still run):
#   1. TPOT: one python process, a Hydra sweep (-m, basic launcher = sequential jobs in-process; model.shapes.reuse
#      builds the 30B model once): engine.decode_path = compiled, graph x B = 1, 16, 64 x sere.k = null, 2, 1
#      on model=qwen3_30b_a3b_shapes, dataset=synthetic_load (prompt 64, output 64 tokens, ignore_eos,
#      num_requests = B: one timed batch after one warm-up batch of the same shape), rho = 0.
#   2. TTFT: model=qwen3_vl_30b_a3b_shapes, 30 images of 448x448 (5,880 visual tokens) + 1,960 prompt tokens,
#      visionzip.keep = 1.0, 0.7, 0.6, 0.5, B = 1, 3 requests, output 8 tokens (decode_path=graph: TTFT only).
#   3. benchmarks/bench_decode_step.py --modes graph (fused MoE kernel; B = 1, 16, 64 x off/k2/k1).
#   4. benchmarks/run_path_breakdown.py: MoE / attention / other per step (compiled step), stock vs the engine's
#      decode kernels, with a torch.profiler kernel-family split.
#   then benchmarks/run_path_collect.py builds results/benchmarks/run_path.json / .md with the goals marked.
# Needs on the GPU box: hydra-core, omegaconf, antlr4 (+ metric wheels: harness.metrics.scoring imports them lazily):
#   ../shared/device/wheels.sh core metrics. wandb is not needed (wandb.mode=disabled imports nothing).
set -u
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HARNESS_CACHE=${HARNESS_CACHE:-/tmp/harness-cache}
export TRANSFORMERS_VERBOSITY=error
RES=results/benchmarks
[ $SMOKE = 1 ] && RES=${SMOKE_OUT:-/tmp/run_path_smoke}
SWEEPS=$RES/run_path_sweeps
mkdir -p "$RES" "$SWEEPS"
COMMON="wandb.mode=disabled cache.enabled=false dataset=synthetic_load hydra.job.chdir=false"
if [ $SMOKE = 1 ]; then
  TEXT=model=qwen3_30b_a3b_shapes_tiny; VL=model=qwen3_vl_30b_a3b_shapes_tiny
  BATCHES=1,4; NIMG=2; PROMPT_VL=16; OUTTOK=6; T1=400; T2=200; T3=200; T4=200
  BENCH_ARGS="--smoke --modes graph --batches 1,4 --steps 3"; BD_ARGS="--smoke --batches 1,4 --steps 3 --paths graph"
  PATHS=graph,eager
else
  TEXT=model=qwen3_30b_a3b_shapes; VL=model=qwen3_vl_30b_a3b_shapes
  BATCHES=1,16,64; NIMG=30; PROMPT_VL=1960; OUTTOK=64; T1=240; T2=90; T3=100; T4=110
  BENCH_ARGS="--modes graph --impls harness_fused_moe --batches 1,16,64 --sere off,k2,k1 --steps 30 --budget-s 85"
  BD_ARGS="--batches 1,16,64 --steps 30 --budget-s 100 --paths compiled --kernels all,stock --profile"
  PATHS=${RUN_PATHS:-compiled,graph}; T1=${T1_S:-$T1}
fi
STAGES=${STAGES:-tpot,ttft,bench,breakdown}   # a subset re-runs those stages; the others' files are reused
want() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
status() { echo "$1 rc=$2 $(date +%T)" | tee -a "$RES/run_path_status.txt"; }
: > "$RES/run_path_status.txt"
t0=$(date +%s)

# 1. TPOT through the run path
if want tpot; then
timeout $T1 $PY -m harness -m $TEXT $COMMON dataset.prompt_tokens=64 dataset.output_tokens=$OUTTOK \
  'dataset.num_requests=${engine.batch_size}' engine.decode_path=$PATHS engine.batch_size=$BATCHES \
  sere.k=null,2,1 sere.rho=0.0 sere.calibration_tokens=2048 hydra.sweep.dir=$SWEEPS/tpot \
  > "$RES/run_path_tpot.log" 2>&1
status tpot $?
fi

# 2. 30-image TTFT through the run path
if want ttft; then
timeout $T2 $PY -m harness -m $VL $COMMON dataset.n_images=$NIMG dataset.prompt_tokens=$PROMPT_VL \
  dataset.output_tokens=8 dataset.num_requests=3 engine.batch_size=1 engine.decode_path=graph \
  visionzip.keep=1.0,0.7,0.6,0.5 hydra.sweep.dir=$SWEEPS/ttft > "$RES/run_path_ttft.log" 2>&1
status ttft $?
fi

# 3. the benchmark script's figures for the same shapes
if want bench; then
timeout $T3 $PY benchmarks/bench_decode_step.py $BENCH_ARGS --out "$RES/run_path_bench_decode_step.json" \
  > "$RES/run_path_bench.log" 2>&1
status bench_decode_step $?
fi

# 4. per-step breakdown
if want breakdown; then
timeout $T4 $PY benchmarks/run_path_breakdown.py $BD_ARGS --out "$RES/run_path_breakdown.json" \
  > "$RES/run_path_breakdown.log" 2>&1
status breakdown $?
fi

$PY benchmarks/run_path_collect.py --dir "$RES" --sweeps "$SWEEPS" --elapsed $(( $(date +%s) - t0 ))
status collect $?
