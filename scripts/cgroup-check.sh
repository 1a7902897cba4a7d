#!/usr/bin/env bash
# Run `bgeserve serve` inside a memory-limited cgroup and throw mixes of texts of up to 8192
# tokens at it, concurrently. Pass: the server is never OOM-killed, every request gets 200 or
# a clear 413, and the cgroup's peak usage stays under its limit.
#
#   sudo [VARIANT=int8] [REQUESTS=12] [IDLE=SECS] scripts/cgroup-check.sh EXPORT_DIR [LIMIT_BYTES]
#
# IDLE: unload the session after SECS idle and send the requests only after that, so they run
# on a reloaded session (a reload once needed more memory than the first load).
#
# Needs a writable cgroup v1 memory controller or cgroup v2 (the process's own cgroup subtree).
set -euo pipefail
export_dir=${1:?usage: cgroup-check.sh EXPORT_DIR [LIMIT_BYTES]}
limit=${2:-$((4 * 1024 * 1024 * 1024))}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

v1=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
if [ -d "$v1" ]; then
  cg=$v1/bgeserve-check-$$
  mkdir "$cg"; echo "$limit" > "$cg/memory.limit_in_bytes"
  usage() { cat "$cg/memory.max_usage_in_bytes"; }
  ooms() { awk '/oom_kill /{print $2}' "$cg/memory.oom_control"; }
else
  cg=/sys/fs/cgroup$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)/bgeserve-check-$$
  mkdir "$cg"; echo "$limit" > "$cg/memory.max"
  usage() { cat "$cg/memory.peak" 2>/dev/null || echo 0; }
  ooms() { awk '/oom_kill /{print $2}' "$cg/memory.events"; }
fi
cleanup() { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rmdir "$cg" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

env_vars=(BGE_M3_MODEL_PATH="$export_dir" BGE_M3_MODEL="${VARIANT:-fp32}" BGE_M3_CACHE_DIR="$work/cache" HF_HUB_OFFLINE=1
          BGE_M3_BIND=127.0.0.1:$port BGE_M3_LOG_FORMAT=json BGE_M3_WORKERS=1
          BGE_M3_REQUEST_TIMEOUT_SECS=0  # long texts queue behind each other on 2 cores
          BGE_M3_IDLE_TIMEOUT_SECS="${IDLE:-300}")
# The probe (in its own process, inside the same cgroup) fits this model's cost; the server then
# starts from the cached fit instead of the upward-biased conservative model.
echo "== probe inside the cgroup (limit $((limit >> 20)) MiB)"
sh -c "echo \$\$ > $cg/cgroup.procs; exec env ${env_vars[*]} $py -m bgeserve probe" | tail -3
echo "== serve inside the cgroup"
sh -c "echo \$\$ > $cg/cgroup.procs; exec env ${env_vars[*]} $py -m bgeserve serve" > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "FAIL: server exited"; tail -5 "$work/server.log"; exit 1; }
  sleep 1
done
curl -s "http://127.0.0.1:$port/health" | "$py" -c 'import json,sys; t=json.load(sys.stdin)["tuning"]; print("tuning:", {k: t[k] for k in ("probe_status","max_workspace_bytes","max_seq_that_fits","memory_source")})'
if [ -n "${IDLE:-}" ]; then
  sleep $((IDLE + 3))
  echo "after the idle unload: $(curl -s "http://127.0.0.1:$port/health" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["status"])')"
fi
set +e
"$py" - "$port" "${REQUESTS:-12}" <<'PY'
import concurrent.futures as cf, random, sys, time
import httpx
port = int(sys.argv[1])
rng = random.Random(0)
def text(tokens):  # ~1 token per short word for the random tokenizer
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "omega"]) for _ in range(tokens))
def request(i):
    lengths = [rng.choice([16, 512, 2048, 4096, 8000, 12000]) for _ in range(rng.randint(1, 8))]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings:both",
                   json={"input": [text(n) for n in lengths]}, timeout=900)
    return r.status_code, lengths
started = time.time()
with cf.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(request, range(int(sys.argv[2]))))
codes = [c for c, _ in results]
print(f"requests: {len(codes)}, statuses: {sorted(set(codes))}, {time.time() - started:.0f} s")
sys.exit(0 if all(c in (200, 413) for c in codes) else 1)
PY
status=$?
set -e
grep -E '"(model loaded|ready: )' "$work/server.log" | cut -c1-240 || true
alive=yes; kill -0 "$server" 2>/dev/null || alive=no
echo "server alive: $alive; cgroup peak $(( $(usage) >> 20 )) MiB of $((limit >> 20)) MiB; oom kills: $(ooms)"
[ "$status" = 0 ] && [ "$alive" = yes ] && [ "$(ooms)" = 0 ] && echo PASS || { echo FAIL; exit 1; }
