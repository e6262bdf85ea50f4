#!/usr/bin/env bash
# kvslim bench on two checkouts, one K/V pair at a time, old then new, in one session:
#   benchmarks/bench_before_after.sh OLD_CHECKOUT NEW_CHECKOUT [PAIRS] > bench.jsonl
# (make an old checkout with `git worktree add /tmp/old <commit>`). Each line of output is one
# llama-bench-style JSON record; a "## CHECKOUT PAIR" line precedes each run.
set -euo pipefail
old=${1:?old checkout}; new=${2:?new checkout}; pairs=${3:-f16/f16 q8_0/q8_0 turbo4/turbo4}
python=${PYTHON:-python3}
for pair in $pairs; do
  for root in "$old" "$new"; do
    echo "## $root $pair"
    (cd "$root" && "$python" -m kvslim bench -p 512 -n 128 -d 0,4096,16384 -r 5 --pairs "$pair" -t 2 \
        --no-progress -o jsonl)
  done
done
