#!/bin/sh
# Container health check: exit 0 only when GET /health on this container's bgeserve answers
# HTTP 200 (status ok, warn or idle); 503 (loading, fail), a refused connection or a timeout
# exit 1. The address comes from BGE_M3_BIND (default 0.0.0.0:8081); a wildcard host (0.0.0.0,
# [::], empty) is polled on loopback. Uses curl when the image has it, else python3's urllib.
# HEALTHCHECK_TIMEOUT (seconds, default 3) bounds the whole request.
set -u

bind="${BGE_M3_BIND:-0.0.0.0:8081}"
port="${bind##*:}"
host="${bind%:*}"
case "$host" in
  "" | "0.0.0.0" | "*") host="127.0.0.1" ;;
  "[::]" | "::" | "[::0]") host="[::1]" ;;
  *:*) case "$host" in "["*) ;; *) host="[$host]" ;; esac ;;  # a bare IPv6 literal
esac
url="http://${host}:${port}/health"
timeout="${HEALTHCHECK_TIMEOUT:-3}"

if command -v curl >/dev/null 2>&1; then
  code="$(curl --silent --output /dev/null --max-time "$timeout" --write-out '%{http_code}' \
    --globoff "$url" 2>/dev/null)"
  [ "$code" = "200" ] && exit 0
  echo "healthcheck: $url answered ${code:-nothing}" >&2
  exit 1
fi

exec python3 - "$url" "$timeout" <<'EOF'
import sys
import urllib.error
import urllib.request

url, timeout = sys.argv[1], float(sys.argv[2])
try:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        code = response.status
except urllib.error.HTTPError as exc:
    code = exc.code
except Exception as exc:  # refused, timed out, reset: all mean unhealthy
    code = f"nothing ({exc})"
if code == 200:
    sys.exit(0)
print(f"healthcheck: {url} answered {code}", file=sys.stderr)
sys.exit(1)
EOF
