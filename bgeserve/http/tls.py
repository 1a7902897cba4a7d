"""HTTPS from ``BGE_M3_TLS_*``: the certificate, its key and, for mutual TLS, a client CA.

``uvicorn_options(settings)`` gives the keyword arguments of ``uvicorn.Config``. The files are
loaded into a throw-away context first, so a missing file, a key that does not match its
certificate or a wrong PEM fails at start-up with the variable named, before a port is bound,
instead of as a traceback from inside uvicorn.
"""

from __future__ import annotations

import ssl
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import ConfigError


def _check_readable(name: str, path: Any) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{name}={path}: cannot read it ({exc.strerror})", param=name) from None


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """``ssl_*`` arguments for uvicorn; ``{}`` when no certificate is configured."""
    cert, key = settings.tls_cert_file, settings.tls_key_file
    client_ca = settings.tls_client_ca_file
    if cert is None:
        return {}
    _check_readable("BGE_M3_TLS_CERT_FILE", cert)
    if key is not None:
        _check_readable("BGE_M3_TLS_KEY_FILE", key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"BGE_M3_TLS_CERT_FILE={cert} / BGE_M3_TLS_KEY_FILE={key}: not a PEM certificate "
            f"chain and its private key ({exc}); without BGE_M3_TLS_KEY_FILE the key must be "
            "in the certificate file", param="BGE_M3_TLS_CERT_FILE") from None
    options: dict[str, Any] = {"ssl_certfile": str(cert)}
    if key is not None:
        options["ssl_keyfile"] = str(key)
    if client_ca is not None:
        _check_readable("BGE_M3_TLS_CLIENT_CA_FILE", client_ca)
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"BGE_M3_TLS_CLIENT_CA_FILE={client_ca}: not PEM CA "
                              f"certificates ({exc})", param="BGE_M3_TLS_CLIENT_CA_FILE") from None
        options.update(ssl_ca_certs=str(client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
