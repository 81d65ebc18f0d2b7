#!/bin/bash
# A/B/A of bench agent_scale --arms stopped on one machine, one after the other
set -u
for step in 1_before 2_after 3_before; do
  wt=/tmp/wt_${step#*_}
  echo "$(date -u +%T) start $step ($(git -C $wt rev-parse --short HEAD))"
  (cd $wt && PYTHONPATH=$wt /work/main/.venv/bin/python -m cli.main bench agent_scale --arms stopped --out /tmp/aba/$step) > /tmp/aba/$step.out 2>&1
  echo "$(date -u +%T) done $step rc=$?"
done
