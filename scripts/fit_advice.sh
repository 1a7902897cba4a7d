#!/bin/bash
# Whether the start-up's "longest that fits" advice holds once followed.
#
#   scripts/fit_advice.sh TREE EXPORT_DIR AVAILABLE_BYTES [PORT]
#
# Three starts of `bgeserve serve` from the checkout TREE (PYTHONPATH) on EXPORT_DIR, fp32,
# one fresh cache folder: at 8,192 tokens with the memory free (its probe is cached), at 8,192
# with BGE_M3_AVAILABLE_MEMORY_BYTES=AVAILABLE_BYTES (refused: "longest that fits: N"), and
# at N with the same cap. Prints, for each, the probe status and max_seq_that_fits /health
# said, the advice, and whether a cached fit for a longer max_seq was read.
tree=$1; export_dir=$2; avail=$3; port=${4:-8613}
dir=$(mktemp -d /tmp/fit-advice.XXXXXX)
python=${PYTHON:-python}
start() {  # MAX_SEQ [AVAILABLE_BYTES]
  env PYTHONPATH="$tree" BGE_M3_MODEL_PATH="$export_dir" BGE_M3_BIND=127.0.0.1:$port \
    BGE_M3_CACHE_DIR="$dir" BGE_M3_MODEL=fp32 BGE_M3_CACHE_MB=0 BGE_M3_MAX_SEQ_LENGTH=$1 \
    ${2:+BGE_M3_AVAILABLE_MEMORY_BYTES=$2} timeout 300 "$python" -m bgeserve serve \
    > "$dir/log.$1.$2" 2>&1 &
  local pid=$! state=""
  for _ in $(seq 280); do
    kill -0 $pid 2>/dev/null || break
    state=$(curl -sf localhost:$port/health | "$python" -c "import json, sys
t = json.load(sys.stdin)['tuning']; print(t['probe_status'], t['max_seq_that_fits'])" 2>/dev/null)
    case "$state" in complete*|cache_hit*|failed*) break;; esac
    sleep 1
  done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  echo "max_seq=$1 available=${2:-all}: health=[$state]" \
    "$(grep -o 'longest that fits: [0-9,]*' "$dir/log.$1.$2" | head -1)" \
    "$(grep -o 'using the fit measured for max_seq [0-9]*' "$dir/log.$1.$2" | head -1)"
}
start 8192
start 8192 "$avail"
n=$(grep -o 'longest that fits: [0-9,]*' "$dir/log.8192.$avail" | head -1 | grep -o '[0-9,]*$' | tr -d ,)
[ -n "$n" ] && start "$n" "$avail"
rm -rf "$dir"
