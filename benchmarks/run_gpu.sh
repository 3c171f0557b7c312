#!/usr/bin/env bash
# Every GPU figure of issue 5 in one command (about 15-25 min on an H100), then RESULTS.md:
#   bash benchmarks/run_gpu.sh
# Each benchmark runs the naive path and ours side by side in one process and writes
# benchmarks/results/*.json; benchmarks/report.py turns them into benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
run() { echo "+ $*"; "$PY" "$@" || echo "FAILED: $*"; }
# Update throughput and memory (goal 1, lever "chunked log-probs", "vision attention")
run benchmarks/bench_update.py --shape 2b --screenshots 5
run benchmarks/bench_update.py --shape 2b --screenshots 15
run benchmarks/bench_update.py --shape 7b --screenshots 5
run benchmarks/bench_update.py --shape 7b --screenshots 15
# Complete updates with the optimizer step (goal 2)
run benchmarks/bench_update.py --shape 2b --screenshots 15 --paths ours --update --optimizer adamw
run benchmarks/bench_update.py --shape 7b --screenshots 15 --paths ours --update --optimizer adamw --lora-rank 16
run benchmarks/bench_update.py --shape 7b --screenshots 15 --paths ours --update --optimizer adafactor
# Rollout generation: 8 environments x 15 steps (goal 3)
run benchmarks/bench_rollout.py --shape 2b --envs 8 --steps 15 --max-new-tokens 48
run benchmarks/bench_rollout.py --shape 7b --envs 8 --steps 15 --max-new-tokens 48
run benchmarks/report.py
