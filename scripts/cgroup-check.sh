#!/usr/bin/env bash
# Run `bgeserve serve` inside a memory-limited cgroup and throw mixes of long texts at it,
# concurrently. Pass: the server is never OOM-killed, every request gets 200 or a clear 413, the
# cgroup's peak usage stays under its limit, and (RESTART=1) a restart with the same settings
# is a probe `cache_hit`.
#
#   sudo [VARIANT=int8] [REQUESTS=12] [IDLE=SECS] [SERVER_PROBE=1] [MAX_SEQ=4096] \
#        [LENGTHS=2048-4096] [TEXTS=1-4] [RESTART=1] scripts/cgroup-check.sh EXPORT_DIR [LIMIT_BYTES]
#
# VARIANT: BGE_M3_MODEL (fp32); `default` leaves it unset (the measured choice).
# SERVER_PROBE=1: no `bgeserve probe` first: the server measures by itself (in a child beside it,
#   or on its own session before it is ready when a second copy of the model does not fit).
# MAX_SEQ: BGE_M3_MAX_SEQ_LENGTH. LENGTHS: tokens per text (by the export's tokenizer, before
#   truncation), LO-HI (drawn uniformly) or a comma list to draw from (default
#   16,512,2048,4096,8000,12000). TEXTS: texts per request, LO-HI or a list (default 1-8).
# IDLE: unload the session after SECS idle and send the requests only after that, so they run
#   on a reloaded session (a reload once needed more memory than the first load).
# RESTART=1: after the requests, stop the server and start it again in the same cgroup; its
#   probe must be a cache_hit.
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
  echo "cgroup v1: $cg"
else
  cg=/sys/fs/cgroup$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)/bgeserve-check-$$
  mkdir "$cg"; echo "$limit" > "$cg/memory.max"
  usage() { cat "$cg/memory.peak" 2>/dev/null || echo 0; }
  ooms() { awk '/oom_kill /{print $2}' "$cg/memory.events"; }
  echo "cgroup v2: $cg"
fi
server=
cleanup() { [ -n "$server" ] && { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }; rmdir "$cg" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

env_vars=(BGE_M3_MODEL_PATH="$export_dir" BGE_M3_CACHE_DIR="$work/cache" HF_HUB_OFFLINE=1
          BGE_M3_BIND=127.0.0.1:$port BGE_M3_LOG_FORMAT=json BGE_M3_WORKERS=1
          BGE_M3_REQUEST_TIMEOUT_SECS=0  # long texts queue behind each other on 2 cores
          BGE_M3_IDLE_TIMEOUT_SECS="${IDLE:-300}")
[ "${VARIANT:-fp32}" != default ] && env_vars+=(BGE_M3_MODEL="${VARIANT:-fp32}")
[ -n "${MAX_SEQ:-}" ] && env_vars+=(BGE_M3_MAX_SEQ_LENGTH="$MAX_SEQ")

health() { curl -s "http://127.0.0.1:$port/health"; }
tuning() {  # the probe's state as /health reports it
  health | "$py" -c 'import json,sys; b=json.load(sys.stdin); t=b.get("tuning",{}); m=b.get("model",{})
print("tuning:", {k: t.get(k) for k in ("probe_status","probe_mode","probe_error","probe_seconds","a_bytes_per_token","b_bytes_per_token_sq","c_bytes_per_run","max_workspace_bytes","max_seq_that_fits","memory_source")},
      "model:", {k: m.get(k) for k in ("variant","choice","candidates")})'
}
probe_status() { health | "$py" -c 'import json,sys; print(json.load(sys.stdin).get("tuning",{}).get("probe_status",""))'; }
start_server() {  # $1: log file
  sh -c "echo \$\$ > $cg/cgroup.procs; exec env ${env_vars[*]} $py -m bgeserve serve" > "$1" 2>&1 &
  server=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 "$server" 2>/dev/null || { echo "FAIL: server exited"; tail -5 "$1"; exit 1; }
    sleep 1
  done
  echo "FAIL: not ready after 900 s"; exit 1
}
wait_probe() {  # until the probe is no longer running (a child probe runs after ready)
  for _ in $(seq 1800); do [ "$(probe_status)" != running ] && return 0; sleep 1; done
}

if [ -z "${SERVER_PROBE:-}" ]; then
  # The probe (in its own process, inside the same cgroup) fits this model's cost; the server
  # then starts from the cached fit instead of the upward-biased conservative model.
  echo "== probe inside the cgroup (limit $((limit >> 20)) MiB)"
  sh -c "echo \$\$ > $cg/cgroup.procs; exec env ${env_vars[*]} $py -m bgeserve probe" | tail -3
fi
echo "== serve inside the cgroup (limit $((limit >> 20)) MiB)"
started=$(date +%s)
start_server "$work/server.log"
echo "ready after $(( $(date +%s) - started )) s"
wait_probe
tuning
if [ -n "${IDLE:-}" ]; then
  sleep $((IDLE + 3))
  echo "after the idle unload: $(health | "$py" -c 'import json,sys; print(json.load(sys.stdin)["status"])')"
fi
set +e
"$py" - "$port" "${REQUESTS:-12}" "${LENGTHS:-16,512,2048,4096,8000,12000}" "${TEXTS:-1-8}" "$export_dir" <<'PY'
import concurrent.futures as cf, pathlib, random, sys, time
import httpx
port, count, lengths, texts, export = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rng = random.Random(0)
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega"]
def draw(spec):
    if "-" in spec:
        lo, hi = map(int, spec.split("-"))
        return rng.randint(lo, hi)
    return rng.choice([int(x) for x in spec.split(",")])
def words(n):
    return " ".join(rng.choice(WORDS) for _ in range(n))
count_tokens = None
try:  # texts sized in tokens of the model's own tokenizer (the random one makes ~3 per word)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(export) / "tokenizer.json"))
    count_tokens = lambda t: len(tok.encode(t).ids)
    per_word = count_tokens(words(2000)) / 2000
except Exception:
    per_word = 1.0
def text(tokens):
    return words(max(1, round(tokens / per_word)))
plans = [[text(draw(lengths)) for _ in range(draw(texts))] for _ in range(count)]
sizes = [[count_tokens(t) if count_tokens else len(t.split()) for t in p] for p in plans]
def request(inputs):
    r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings:both", json={"input": inputs}, timeout=1800)
    return r.status_code
started = time.time()
with cf.ThreadPoolExecutor(4) as pool:
    codes = list(pool.map(request, plans))
print(f"requests: {len(codes)} ({'tokens' if count_tokens else 'words'} per text: {sizes}), statuses: {codes}, {time.time() - started:.0f} s")
sys.exit(0 if all(c in (200, 413) for c in codes) else 1)
PY
status=$?
set -e
grep -E '"(model loaded|ready: |probe complete|probe gave|variant choice)' "$work/server.log" | cut -c1-300 || true
alive=yes; kill -0 "$server" 2>/dev/null || alive=no
echo "server alive: $alive; cgroup peak $(( $(usage) >> 20 )) MiB of $((limit >> 20)) MiB; oom kills: $(ooms)"
restart=ok
if [ -n "${RESTART:-}" ] && [ "$alive" = yes ]; then
  kill "$server"; wait "$server" 2>/dev/null || true; server=
  echo "== restart inside the cgroup (same cache)"
  started=$(date +%s)
  start_server "$work/server2.log"
  echo "ready after $(( $(date +%s) - started )) s"
  tuning
  [ "$(probe_status)" = cache_hit ] || restart=fail
  echo "restart probe status: $(probe_status)"
fi
[ "$status" = 0 ] && [ "$alive" = yes ] && [ "$(ooms)" = 0 ] && [ "$restart" = ok ] && echo PASS || { echo FAIL; exit 1; }
