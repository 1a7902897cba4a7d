"""HTTPS from BGE_M3_TLS_*: the options uvicorn gets, a live server with a self-signed
certificate made here, mutual TLS, and healthcheck.sh speaking HTTPS."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from bgeserve.config import Settings
from bgeserve.errors import ConfigError
from bgeserve.http import tls
from bgeserve.http.app import create_app
from tests.fakes import FakeService
from tests.serverproc import ServerProc
from tests.test_server_live import START_TIMEOUT, server_env
from tests.uvithread import serving

HEALTHCHECK = Path(__file__).resolve().parent.parent / "healthcheck.sh"
OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl CLI is not installed")
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed server certificate for 127.0.0.1, and a CA with one client certificate."""
    if OPENSSL is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", *EC, "-keyout", str(d / "server.key"), "-out",
             str(d / "server.pem"), "-days", "2", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    _openssl("req", "-x509", *EC, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"),
             "-days", "2", "-subj", "/CN=bgeserve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", *EC, "-keyout", str(d / "client.key"), "-out", str(d / "client.csr"),
             "-subj", "/CN=client")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(d / "client.csr"), "-CA", str(d / "ca.pem"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", str(d / "client.pem"),
             "-days", "2", "-extfile", str(d / "client.ext"))
    (d / "bundle.pem").write_bytes((d / "server.pem").read_bytes()
                                   + (d / "server.key").read_bytes())
    return {p.stem if p.suffix == ".pem" else p.name: p for p in d.iterdir()}


def _trusting(pki: dict[str, Path], client: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["server"]))
    if client:
        context.load_cert_chain(pki["client"], pki["client.key"])
    return context


def healthcheck(bind: str, path: str, **env: str) -> subprocess.CompletedProcess:
    """healthcheck.sh with BGE_M3_BIND=bind and the extra variables."""
    return subprocess.run(["/bin/sh", str(HEALTHCHECK)], capture_output=True, text=True,
                          timeout=30, check=False,
                          env={"BGE_M3_BIND": bind, "HEALTHCHECK_TIMEOUT": "5", "PATH": path,
                               **env})


@pytest.fixture(scope="module")
def client_paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """PATHs for healthcheck.sh: the usual one (curl, when installed), and one holding only
    python3 (its fallback)."""
    bare = tmp_path_factory.mktemp("python-only")
    (bare / "python3").symlink_to(sys.executable)
    return [os.environ["PATH"]] * (shutil.which("curl") is not None) + [str(bare)]


# -- the options ------------------------------------------------------------------------------
def test_no_certificate_means_plain_http() -> None:
    """Without BGE_M3_TLS_CERT_FILE uvicorn gets no ssl option at all."""
    assert tls.uvicorn_options(Settings()) == {}


@needs_openssl
def test_certificate_key_and_client_ca_become_uvicorn_options(pki: dict[str, Path]) -> None:
    """cert + key → ssl_certfile/ssl_keyfile; a client CA adds ssl_ca_certs and requires
    client certificates; a bundle holding both needs no key file."""
    plain = tls.uvicorn_options(Settings(tls_cert_file=pki["server"],
                                         tls_key_file=pki["server.key"]))
    assert plain == {"ssl_certfile": str(pki["server"]), "ssl_keyfile": str(pki["server.key"])}
    mutual = tls.uvicorn_options(Settings(tls_cert_file=pki["server"],
                                          tls_key_file=pki["server.key"],
                                          tls_client_ca_file=pki["ca"]))
    assert mutual["ssl_ca_certs"] == str(pki["ca"])
    assert mutual["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert tls.uvicorn_options(Settings(tls_cert_file=pki["bundle"])) == {
        "ssl_certfile": str(pki["bundle"])}


@needs_openssl
def test_bad_files_fail_at_start_naming_the_variable(pki: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """A missing certificate, a key of another certificate, a CA file that is not PEM: each
    is a ConfigError naming its variable."""
    with pytest.raises(ConfigError, match="BGE_M3_TLS_CERT_FILE=.*cannot read"):
        tls.uvicorn_options(Settings(tls_cert_file=tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="BGE_M3_TLS_KEY_FILE"):
        tls.uvicorn_options(Settings(tls_cert_file=pki["server"], tls_key_file=pki["ca.key"]))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="BGE_M3_TLS_CLIENT_CA_FILE"):
        tls.uvicorn_options(Settings(tls_cert_file=pki["bundle"], tls_client_ca_file=junk))


def test_a_key_or_client_ca_needs_a_certificate() -> None:
    """BGE_M3_TLS_KEY_FILE or BGE_M3_TLS_CLIENT_CA_FILE alone is refused when read."""
    for name in ("BGE_M3_TLS_KEY_FILE", "BGE_M3_TLS_CLIENT_CA_FILE"):
        with pytest.raises(ConfigError, match=f"{name} needs BGE_M3_TLS_CERT_FILE"):
            Settings.from_env({name: "/x.pem"})


@needs_openssl
def test_a_bad_certificate_stops_serve_with_exit_2(tmp_path: Path) -> None:
    """`bgeserve serve` refuses to start (exit 2, the variable named) on an unreadable cert."""
    env = {"BGE_M3_TLS_CERT_FILE": str(tmp_path / "missing.pem"),
           "BGE_M3_CACHE_DIR": str(tmp_path)}
    with ServerProc(env) as proc:
        assert proc.wait(timeout=60) == 2
        assert "BGE_M3_TLS_CERT_FILE" in "\n".join(proc.stderr_lines)


# -- a live server ----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_live_server_serves_https(tiny_export: Path, tmp_path: Path, pki: dict[str, Path],
                                    client_paths: list[str]) -> None:
    """With a self-signed certificate: HTTPS answers (health, embeddings) for a client that
    trusts it, plain HTTP on that port gets no answer, and healthcheck.sh passes only when it
    knows the server speaks TLS."""
    env = server_env(tiny_export, tmp_path / "cache", BGE_M3_TLS_CERT_FILE=str(pki["server"]),
                     BGE_M3_TLS_KEY_FILE=str(pki["server.key"]))
    with ServerProc(env, verify=_trusting(pki)) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        assert proc.url.startswith("https://")
        with httpx.Client(base_url=proc.url, verify=_trusting(pki), timeout=30) as client:
            r = client.post("/v1/embeddings", json={"input": ["over TLS"]})
            assert r.status_code == 200 and len(r.json()["data"]) == 1
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{proc.port}/health", timeout=5)
        bind = f"0.0.0.0:{proc.port}"
        for path in client_paths:
            ok = healthcheck(bind, path, BGE_M3_TLS_CERT_FILE=str(pki["server"]))
            assert ok.returncode == 0, (path, ok.stderr)
            # the reference server's name, which the server reads as BGE_M3_TLS_CERT_FILE
            ok = healthcheck(bind, path, BGE_M3_TLS_CERT_PATH=str(pki["server"]))
            assert ok.returncode == 0, (path, ok.stderr)
            assert healthcheck(bind, path).returncode == 1  # plain HTTP to a TLS port


@contextmanager
def _fake_tls_server(settings: Settings) -> Iterator[int]:
    """The app over a fake service under uvicorn with the settings' TLS options; the port."""
    fake = FakeService(settings=settings)
    config = uvicorn.Config(create_app(settings, lambda _: fake), log_level="critical",
                            **tls.uvicorn_options(settings))
    with serving(uvicorn.Server(config)) as (port, _):
        yield port


@needs_openssl
def test_mutual_tls_requires_a_client_certificate(pki: dict[str, Path],
                                                  client_paths: list[str]) -> None:
    """With BGE_M3_TLS_CLIENT_CA_FILE a client without a certificate signed by that CA is
    refused in the handshake; with one it is served; healthcheck.sh presents
    HEALTHCHECK_CERT_FILE / HEALTHCHECK_KEY_FILE."""
    settings = Settings(tls_cert_file=pki["server"], tls_key_file=pki["server.key"],
                        tls_client_ca_file=pki["ca"])
    with _fake_tls_server(settings) as port:
        url = f"https://127.0.0.1:{port}/health"
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=_trusting(pki), timeout=5)
        r = httpx.get(url, verify=_trusting(pki, client=True), timeout=5)
        assert r.status_code == 200
        bind = f"127.0.0.1:{port}"
        tls_env = {"BGE_M3_TLS_CERT_FILE": str(pki["server"])}
        for path in client_paths:
            assert healthcheck(bind, path, **tls_env).returncode == 1
            ok = healthcheck(bind, path, **tls_env, HEALTHCHECK_CERT_FILE=str(pki["client"]),
                             HEALTHCHECK_KEY_FILE=str(pki["client.key"]))
            assert ok.returncode == 0, (path, ok.stderr)
