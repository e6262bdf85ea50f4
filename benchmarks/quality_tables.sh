#!/usr/bin/env bash
# Regenerate the README's quality tables on the bundled weights, one command per table, in one run:
#   bash benchmarks/quality_tables.sh [OUT_DIR]          (default: docs/)
# Writes eval-kld-c4096.md, eval-depth.{json,png}, eval-niah.{md,png}, eval-sampling.md and
# ruler-16k.md into OUT_DIR, and times.tsv with each step's wall seconds. Run it on an idle
# machine: the figures are quality, not speed, but the whole run takes tens of minutes on 2 cores.
# PAIRS, NIAH_LENGTHS, NIAH_DEPTHS, NIAH_SAMPLES, DEPTH_CTX override the defaults below; STEPS
# names the steps to run (default: all, "kld depth niah sampling ruler").
set -euo pipefail
out=${1:-docs}
python=${PYTHON:-python3}
pairs=${PAIRS:-f16,q8_0,q4_0,iq4_nl,turbo4,turbo3,turbo2,q8_0/turbo3}
quantized=${pairs#f16,}                      # the pairs compared against the f16 base
depth_ctx=${DEPTH_CTX:-32768}
niah_lengths=${NIAH_LENGTHS:-4096,8192,16384}
niah_depths=${NIAH_DEPTHS:-0,0.25,0.5,0.75,1}
niah_samples=${NIAH_SAMPLES:-1}
steps=" ${STEPS:-kld depth niah sampling ruler} "
mkdir -p "$out"
: >> "$out/times.tsv"

step() {  # step NAME FILE EVAL-ARGS...: kvslim eval EVAL-ARGS > OUT_DIR/FILE, "NAME seconds" to times.tsv
  local name=$1 file=$2; shift 2
  [[ $steps == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "## $name: kvslim eval $*" >&2
  "$python" -m kvslim eval "$@" --no-progress > "$out/$file"
  printf '%s\t%s\n' "$name" "$((SECONDS - t0))" >> "$out/times.tsv"
}

step kld eval-kld-c4096.md kld -c 4096 --pairs "$pairs" -o md
step depth eval-depth.json depth -c "$depth_ctx" --pairs "$quantized" --png "$out/eval-depth.png" -o json
step niah eval-niah.md niah -c "${niah_lengths##*,}" --lengths "$niah_lengths" --depths "$niah_depths" \
  -n "$niah_samples" --pairs "$pairs" --png "$out/eval-niah.png" -o md
step sampling eval-sampling.md sampling --chunks 2 --pairs "$quantized" -o md
step ruler ruler-16k.md ruler -c 16384 --pairs f16,q8_0/turbo4,turbo3 -n 1 --png "$out/ruler.png" -o md
cat "$out/times.tsv" >&2
