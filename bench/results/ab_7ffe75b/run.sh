#!/bin/bash
# A/B alternated: bench/allreduce.py --quick and bench/skew.py --quick, 7ffe75b (base) vs HEAD (new)
mkdir -p /tmp/ab
for i in 1 2 3; do
  for side in base new; do
    d=/tmp/base; [ $side = new ] && d=/tmp/newab
    (cd $d && PYTHONPATH=$d timeout 900 /work/main/.venv/bin/python bench/allreduce.py --quick --impls asynccoll-tcp,asynccoll-shm,asynccoll-partial-shm,asynccoll-partial-tcp --P 4 --out /tmp/ab/${side}_allreduce_$i.json > /tmp/ab/${side}_allreduce_$i.log 2>&1)
    (cd $d && PYTHONPATH=$d timeout 900 /work/main/.venv/bin/python bench/skew.py --quick --out /tmp/ab/${side}_skew_$i.json > /tmp/ab/${side}_skew_$i.log 2>&1)
    echo "$(date +%T) $side $i load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/ab/progress
  done
done
