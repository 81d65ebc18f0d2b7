#!/usr/bin/env bash
# usage: cluster_loop.sh N LABEL [busy]  -- runs tests/integration/test_cluster.py N times from /tmp/clone
N=$1; LABEL=$2; BUSY=${3:-}
cd /tmp/clone
LOG=/tmp/cluster_$LABEL.log
: > $LOG
pids=()
if [ -n "$BUSY" ]; then
  yes > /dev/null & pids+=($!)
  yes > /dev/null & pids+=($!)
  echo "busy loops: ${pids[*]}" >> $LOG
fi
pass=0
for i in $(seq 1 $N); do
  start=$(date +%s)
  if PYTHONPATH=/tmp/clone .venv/bin/python -m pytest -q -x -p no:cacheprovider --basetemp=/tmp/cluster_runs/$LABEL-$i tests/integration/test_cluster.py > /tmp/cluster_runs/$LABEL-$i.out 2>&1; then
    pass=$((pass+1)); echo "run $i: PASS $(( $(date +%s) - start ))s $(tail -1 /tmp/cluster_runs/$LABEL-$i.out)" >> $LOG
  else
    echo "run $i: FAIL $(( $(date +%s) - start ))s $(tail -1 /tmp/cluster_runs/$LABEL-$i.out)" >> $LOG
  fi
done
echo "done: $pass/$N passed" >> $LOG
for p in "${pids[@]}"; do kill $p; done
