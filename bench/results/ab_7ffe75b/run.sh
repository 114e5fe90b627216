#!/bin/bash
# A/B alternated: bench/allreduce.py --quick and bench/skew.py --quick, 7ffe75b (base, a
# worktree at /tmp/base) against HEAD (new, a worktree at /tmp/newab), N pairs (default 4), the
# side that goes first swapped every pair; JSON in /tmp/ab, compared by compare.py beside this.
N=${1:-4}
mkdir -p /tmp/ab
for i in $(seq 1 "$N"); do
  order="base new"; [ $((i % 2)) = 0 ] && order="new base"
  for side in $order; do
    d=/tmp/base; [ $side = new ] && d=/tmp/newab
    (cd $d && PYTHONPATH=$d timeout 900 /work/main/.venv/bin/python bench/allreduce.py --quick --impls asynccoll-tcp,asynccoll-shm,asynccoll-partial-shm,asynccoll-partial-tcp --P 4 --out /tmp/ab/${side}_allreduce_$i.json > /tmp/ab/${side}_allreduce_$i.log 2>&1)
    (cd $d && PYTHONPATH=$d timeout 900 /work/main/.venv/bin/python bench/skew.py --quick --out /tmp/ab/${side}_skew_$i.json > /tmp/ab/${side}_skew_$i.log 2>&1)
    echo "$(date +%T) $side $i load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/ab/progress
  done
done
