#!/usr/bin/env bash
# Serve bge-m3 and its reranker in one memory-limited cgroup and rerank a ~32k-token document
# by windows, with the cross-encoder and with bge-m3's own (hybrid) scores. Pass: every request
# gets 200 with the document scored over several windows, the server is never OOM-killed, and
# the cgroup's peak stays under its limit.
#
#   [VARIANT=int8] [RERANK_VARIANT=int8] [TOKENS=32768] [MODELS="bge-reranker-v2-m3 bge-m3"] \
#   [RERANK_MAX_LENGTH=8192] [MAX_SEQ=8192] [WAIT_PROBE=1] \
#     scripts/rerank-cgroup-check.sh M3_EXPORT RERANK_EXPORT [LIMIT_BYTES]
#
# MODELS: the scorers to rerank the document with (each one request; empty: none, e.g. to
# probe once into CACHE_DIR, the server's BGE_M3_CACHE_DIR, default a fresh one). WAIT_PROBE=1: send the
# requests only once both tuners have settled (probe complete, cached, skipped or failed), so
# the document is scored under the budgets the server decided, not beside a probe child.
#
# Needs a writable cgroup v1 memory controller or cgroup v2 (the process's own cgroup subtree).
set -euo pipefail
m3=${1:?usage: rerank-cgroup-check.sh M3_EXPORT RERANK_EXPORT [LIMIT_BYTES]}
rr=${2:?usage: rerank-cgroup-check.sh M3_EXPORT RERANK_EXPORT [LIMIT_BYTES]}
limit=${3:-$((4 * 1024 * 1024 * 1024))}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

v1=/sys/fs/cgroup/memory$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
if [ -d "$v1" ]; then
  cg=$v1/bgeserve-rerank-check-$$
  mkdir "$cg"; echo "$limit" > "$cg/memory.limit_in_bytes"
  usage() { cat "$cg/memory.max_usage_in_bytes"; }
  ooms() { awk '/oom_kill /{print $2}' "$cg/memory.oom_control"; }
else
  cg=/sys/fs/cgroup$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)/bgeserve-rerank-check-$$
  mkdir "$cg"; echo "$limit" > "$cg/memory.max"
  usage() { cat "$cg/memory.peak" 2>/dev/null || echo 0; }
  ooms() { awk '/oom_kill /{print $2}' "$cg/memory.events"; }
fi
cleanup() { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rmdir "$cg" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

env_vars=(BGE_M3_MODEL_PATH="$m3" BGE_M3_MODEL="${VARIANT:-int8}" BGE_M3_CACHE_DIR="${CACHE_DIR:-$work/cache}"
          BGE_M3_RERANK_MODEL_PATH="$rr" BGE_M3_RERANK_VARIANT="${RERANK_VARIANT:-int8}"
          HF_HUB_OFFLINE=1 BGE_M3_BIND=127.0.0.1:$port BGE_M3_LOG_FORMAT=json BGE_M3_WORKERS=1
          BGE_M3_MAX_TEXT_CHARS=1000000 BGE_M3_REQUEST_TIMEOUT_SECS=0
          BGE_M3_RERANK_MAX_LENGTH="${RERANK_MAX_LENGTH:-8192}" BGE_M3_MAX_SEQ_LENGTH="${MAX_SEQ:-8192}")
echo "== serve inside the cgroup (limit $((limit >> 20)) MiB)"
sh -c "echo \$\$ > $cg/cgroup.procs; exec env ${env_vars[*]} $py -m bgeserve serve" > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 900); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "FAIL: server exited"; tail -5 "$work/server.log"; exit 1; }
  sleep 1
done
settled() {  # both tuners past "running" (or WAIT_PROBE=0)
  [ "${WAIT_PROBE:-1}" = 0 ] && return 0
  curl -s "http://127.0.0.1:$port/health" | "$py" -c "
import json, sys
h = json.load(sys.stdin)
sys.exit(any(p['tuning']['probe_status'] == 'running' for p in (h, h['reranker'])))"
}
for _ in $(seq 1800); do
  settled && break
  kill -0 "$server" 2>/dev/null || { echo "FAIL: server exited"; tail -5 "$work/server.log"; exit 1; }
  sleep 1
done
echo "== ready after $SECONDS s; cgroup peak so far $(( $(usage) >> 20 )) MiB"
curl -s "http://127.0.0.1:$port/health" | "$py" -c "
import json, sys
h = json.load(sys.stdin)
for name, part in (('bge-m3', h), ('reranker', h['reranker'])):
    t = part['tuning']
    print(name, 'probe', t['probe_status'], t['max_workspace_bytes'] >> 20, 'MiB workspace, fits',
          t['max_seq_that_fits'], 'tokens; memory', t['available_bytes'] >> 20, 'MiB,',
          t['memory_source'])"
set +e
"$py" - "$port" "$rr/tokenizer.json" "${TOKENS:-32768}" ${MODELS-bge-reranker-v2-m3 bge-m3} <<'PY'
import sys, time
import httpx
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.export.texts import random_texts
port, tokenizer, target = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tk = Tokenizer.load(tokenizer, 1 << 30)
words, doc = random_texts(2026, 4000, 20, 40), ""
for i, w in enumerate(words):  # grow until the document has `target` tokens
    doc += (" " if doc else "") + w
    if i % 50 == 0 and len(tk.encode([doc]).ids[0]) >= target:
        break
tokens = len(tk.encode([doc]).ids[0])
query = random_texts(7, 1, 8, 8)[0]
ok = True
for model in sys.argv[4:]:
    started = time.time()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/rerank", timeout=3600,
                   json={"model": model, "query": query, "documents": [doc, "a short one"]})
    body = r.json() if r.status_code == 200 else r.text[:300]
    windows = {x["index"]: x.get("windows", 1) for x in body["results"]} if r.status_code == 200 else None
    usage = body["usage"]["total_tokens"] if r.status_code == 200 else None
    print(f"{model}: HTTP {r.status_code}, document of {tokens} tokens ({len(doc)} chars), "
          f"windows {windows}, {usage} tokens scored, {time.time() - started:.0f} s")
    if r.status_code != 200:
        print(body)
    ok &= r.status_code == 200 and windows[0] > 1
sys.exit(0 if ok else 1)
PY
status=$?
set -e
alive=yes; kill -0 "$server" 2>/dev/null || alive=no
echo "server alive: $alive; cgroup peak $(( $(usage) >> 20 )) MiB of $((limit >> 20)) MiB; oom kills: $(ooms)"
[ "$status" = 0 ] && [ "$alive" = yes ] && [ "$(ooms)" = 0 ] && echo PASS || { echo FAIL; tail -20 "$work/server.log" | cut -c1-300; exit 1; }
