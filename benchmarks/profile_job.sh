#!/usr/bin/env bash
# Profile the generate actor, the trainer rank and the driver of a streaming job with py-spy.
#   bash benchmarks/profile_job.sh [MODE] [STEPS] [SECONDS]    (defaults: stream2 10 30)
# Starts benchmarks/throughput.py for one mode, waits for its first step (start-up is not
# profiled), samples each process for SECONDS at 100 Hz, and prints the hottest functions
# (self time) per process. Raw stacks land in benchmarks/results/profile_*.txt.
# Needs py-spy (pip install py-spy) and a machine where no other streamrl job runs.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-stream2}; STEPS=${2:-10}; SECONDS_=${3:-30}
PY=${PY:-.venv/bin/python}
LOG=$(mktemp)
$PY benchmarks/throughput.py --modes "$MODE" --steps "$STEPS" --name "profile_$MODE" >"$LOG" 2>&1 &
JOB=$!
trap 'kill $JOB 2>/dev/null || true' EXIT
until grep -q "step    1/" "$LOG"; do sleep 1; kill -0 $JOB 2>/dev/null || { cat "$LOG"; exit 1; }; done
declare -A PIDS=(
  [generate]=$(pgrep -f "ray::MapWorker\(MapBatches\(Generate\)\)" | head -1)
  [trainer]=$(pgrep -f "ray::TrainWorker" | head -1)
  [train_op]=$(pgrep -f "ray::MapWorker\(MapBatches\(AdvantageTrain\)\)" | head -1)
)
for name in "${!PIDS[@]}"; do
  "$(dirname "$PY")/py-spy" record --pid "${PIDS[$name]}" --duration "$SECONDS_" --rate 100 --format raw \
    --output "benchmarks/results/profile_${MODE}_${name}.txt" --nonblocking >/dev/null 2>&1 &
done
wait $(jobs -p | grep -v "^$JOB$") 2>/dev/null || true
for name in "${!PIDS[@]}"; do
  echo "== $name (pid ${PIDS[$name]}): hottest functions, share of samples (self)"
  $PY - "benchmarks/results/profile_${MODE}_${name}.txt" <<'PYEOF'
import collections, sys
self_time, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    if not stack:
        continue
    total += int(count)
    self_time[stack.split(";")[-1]] += int(count)
for frame, count in self_time.most_common(8):
    print(f"  {count / max(total, 1):6.1%}  {frame[:140]}")
print(f"  ({total} samples)")
PYEOF
done
wait $JOB || true
grep -E "overlap|samples/s" "$LOG" | tail -3
