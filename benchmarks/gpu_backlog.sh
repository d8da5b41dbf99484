#!/usr/bin/env bash
# The GPU backlog (../shared/notes/gpu-backlog.md) as one time-boxed script for a lent GPU machine.
#
#   OUT=/some/folder bash benchmarks/gpu_backlog.sh
#
# Writes at most 12 files to $OUT: env.txt, gpu-tests.log, mfu.log, mfu_<dev>.json,
# mfu_<dev>_eager.json, mfu_<dev>_float8_tensorwise.json, mfu_<dev>_float8_rowwise.json,
# overhead.log, overhead_gpu_<dev>.json, moe.log, moe_gpu_<dev>.json, cpu-suite.log. Each step
# has its own time limit (seconds, below) so that one slow step cannot eat the whole lease, cut
# to what is left before DEADLINE (seconds after the start; a step with under 30 s left is
# skipped, and its log says so); the CPU-only multi-rank tests run on cores 8-15 beside the
# GPU steps, which are pinned to cores 0-7. The float8 steps need torchao: without it mfu.py
# says "torchao not installed" (rc=2, the JSON says why) and the script goes on.
set -u
OUT=${OUT:?set OUT to a folder for the logs}
DEV=${DEV:-gpu}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
T_TESTS=${T_TESTS:-150} T_MFU=${T_MFU:-90} T_EAGER=${T_EAGER:-50} T_OVER=${T_OVER:-75} T_CPU=${T_CPU:-480}
T_F8=${T_F8:-90} T_MOE=${T_MOE:-170} T_F8ROW=${T_F8ROW:-80} DEADLINE=${DEADLINE:-530}
t0=$(date +%s)
PIN_GPU=(taskset -c 0-7) PIN_CPU=(taskset -c 8-15)
command -v taskset >/dev/null || PIN_GPU=() PIN_CPU=()  # no util-linux: run unpinned
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

{
  stamp "install"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 \
    || echo "pip install failed; using PYTHONPATH"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import meshtrain, transformers, lightning; print('meshtrain at', meshtrain.__file__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)"
  python3 -c "import os; print(len(os.sched_getaffinity(0)), 'cores')"
} >"$OUT/env.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

(
  s=$(date +%s)
  CUDA_VISIBLE_DEVICES= timeout "$T_CPU" "${PIN_CPU[@]}" python3 -m pytest -q -n 6 --timeout 300 \
    -p no:cacheprovider tests/parallel tests/models >"$OUT/cpu-suite.log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - s )) s (pytest -n 6 on cores 8-15, beside the GPU steps)" >>"$OUT/cpu-suite.log"
) &

run_step() {  # name limit log cmd...
  local name=$1 limit=$2 log=$3; shift 3
  local s; s=$(date +%s)
  local left=$(( DEADLINE - (s - t0) ))
  if (( left < 30 )); then
    stamp "[$name] skipped: ${left} s left before the ${DEADLINE} s deadline: $*" >>"$log"
    return
  fi
  (( limit > left )) && limit=$left
  stamp "$name (limit $limit s): $*" >>"$log"
  timeout "$limit" "${PIN_GPU[@]}" "$@" >>"$log" 2>&1
  echo "[$name] rc=$? wall=$(( $(date +%s) - s )) s" >>"$log"
}

run_step gpu-tests "$T_TESTS" "$OUT/gpu-tests.log" python3 -m pytest -m gpu -q -n 3 --timeout 150 -p no:cacheprovider tests
run_step mfu "$T_MFU" "$OUT/mfu.log" python3 benchmarks/mfu.py --steps 150 --out "$OUT/mfu_${DEV}.json"
run_step mfu-eager "$T_EAGER" "$OUT/mfu.log" python3 benchmarks/mfu.py --steps 40 --compile false --out "$OUT/mfu_${DEV}_eager.json"
run_step overhead "$T_OVER" "$OUT/overhead.log" python3 benchmarks/overhead_gpu.py --repeats 3 --out "$OUT/overhead_gpu_${DEV}.json"
# issue 79 (backlog item 6): float8 against the bf16 run above (same model, steps, compile), and
# the MoE GPT / dense GPT / transformers' Qwen3-MoE on one GPU (each row's JSON written as it ends)
run_step mfu-float8 "$T_F8" "$OUT/mfu.log" python3 benchmarks/mfu.py --steps 150 --float8 tensorwise --out "$OUT/mfu_${DEV}_float8_tensorwise.json"
run_step moe "$T_MOE" "$OUT/moe.log" python3 benchmarks/moe.py --device cuda --out "$OUT/moe_gpu_${DEV}.json"
run_step mfu-float8-rowwise "$T_F8ROW" "$OUT/mfu.log" python3 benchmarks/mfu.py --steps 100 --float8 rowwise --out "$OUT/mfu_${DEV}_float8_rowwise.json"
stamp "GPU steps done; waiting for the CPU suite" >>"$OUT/env.txt"
wait
stamp "all done" >>"$OUT/env.txt"
