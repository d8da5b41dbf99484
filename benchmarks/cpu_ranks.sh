#!/usr/bin/env bash
# Issue 29's check on a lent GPU machine's 16 CPU cores (run it after benchmarks/gpu_backlog.sh):
# the sharding and pipeline tables on 4 and 8 gloo ranks, one core per rank, each step under
# its own time limit (seconds) so that the whole fits a short lease.
#
#   OUT=/some/folder bash benchmarks/cpu_ranks.sh
#
# Writes to $OUT: cpu-ranks.log, sharding_w4/ and sharding_w8/ (sharding.json + chart),
# pipeline/pp4/ and pipeline/pp8/ (pipeline.json + charts).
set -u
OUT=${OUT:?set OUT to a folder for the logs}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T_SHARD=${T_SHARD:-100} T_PIPE=${T_PIPE:-120}
log=$OUT/cpu-ranks.log
step() {  # limit cmd...
  local limit=$1 s; shift
  s=$(date +%s)
  echo "== $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "rc=$? wall=$(( $(date +%s) - s )) s" >>"$log"
}
for w in 4 8; do
  step "$T_SHARD" python3 benchmarks/sharding.py --world-size "$w" --steps 20 --repeats 3 \
    --layouts dp,zero2,zero3,zero2-gloo,zero3-gloo --out-dir "$OUT/sharding_w$w"
done
for p in 4 8; do
  step "$T_PIPE" python3 benchmarks/pipeline.py --pp "$p" --microbatches "$p,$((2 * p))" \
    --repeats 2 --out-dir "$OUT/pipeline"
done
