#!/bin/sh
# Container health check: exit 0 only when GET /health on this container's bgeserve answers
# HTTP 200 (status ok, warn or idle); 503 (loading, fail), a refused connection or a timeout
# exit 1. The address comes from BGE_M3_BIND (default 0.0.0.0:8081); a wildcard host (0.0.0.0,
# [::], empty) is polled on loopback. Uses curl when the image has it, else python3's urllib.
# HEALTHCHECK_TIMEOUT (seconds, default 3) bounds the whole request.
# With BGE_M3_TLS_CERT_FILE set the server speaks HTTPS, and so does this check. It does not
# verify the server's certificate (that names the service, not loopback; the check is about
# liveness, not identity). Under mutual TLS (BGE_M3_TLS_CLIENT_CA_FILE) it presents
# HEALTHCHECK_CERT_FILE (and HEALTHCHECK_KEY_FILE, unless the key is in that file).
set -u

bind="${BGE_M3_BIND:-0.0.0.0:8081}"
port="${bind##*:}"
host="${bind%:*}"
case "$host" in
  "" | "0.0.0.0" | "*") host="127.0.0.1" ;;
  "[::]" | "::" | "[::0]") host="[::1]" ;;
  *:*) case "$host" in "["*) ;; *) host="[$host]" ;; esac ;;  # a bare IPv6 literal
esac
scheme="http"
# BGE_M3_TLS_CERT_PATH: the reference server's name, which bgeserve reads as the same.
[ -n "${BGE_M3_TLS_CERT_FILE:-}${BGE_M3_TLS_CERT_PATH:-}" ] && scheme="https"
url="${scheme}://${host}:${port}/health"
timeout="${HEALTHCHECK_TIMEOUT:-3}"
cert="${HEALTHCHECK_CERT_FILE:-}"
key="${HEALTHCHECK_KEY_FILE:-}"

if command -v curl >/dev/null 2>&1; then
  set --
  [ "$scheme" = "https" ] && set -- --insecure
  [ -n "$cert" ] && set -- "$@" --cert "$cert"
  [ -n "$key" ] && set -- "$@" --key "$key"
  code="$(curl --silent --output /dev/null --max-time "$timeout" --write-out '%{http_code}' \
    --globoff "$@" "$url" 2>/dev/null)"
  [ "$code" = "200" ] && exit 0
  echo "healthcheck: $url answered ${code:-nothing}" >&2
  exit 1
fi

exec python3 - "$url" "$timeout" "$cert" "$key" <<'PYEOF'
import ssl
import sys
import urllib.error
import urllib.request

url, timeout, cert, key = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if cert:
            context.load_cert_chain(cert, key or None)
    with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
        code = response.status
except urllib.error.HTTPError as exc:
    code = exc.code
except Exception as exc:  # refused, timed out, reset, a refused handshake: unhealthy
    code = f"nothing ({exc})"
if code == 200:
    sys.exit(0)
print(f"healthcheck: {url} answered {code}", file=sys.stderr)
sys.exit(1)
PYEOF
