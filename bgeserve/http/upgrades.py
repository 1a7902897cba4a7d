"""uvicorn's httptools protocol, answering an ``Upgrade`` request as the HTTP/1.1 request it is
and the parser's own refusals in the JSON envelope.

An HTTP/1.1 server may ignore ``Upgrade`` (RFC 9110 §7.8) and answer the request itself; curl's
``--http2`` on http://, Java's ``HttpClient`` and Spring's ``RestClient`` send ``Upgrade: h2c``
by default. llhttp, though, stops parsing at the end of such a request's head: it reports the
message complete without a body and hands back the bytes that follow as the new protocol's.
uvicorn then ran the request with an empty body (a valid POST answered 400 "empty document",
uvicorn#2722, httptools#124) and read the body as the next request's head. Here, when the
upgrade is not taken (bgeserve serves no WebSocket), the request gets its body back: a fresh
parser is given a head with the request's own framing (its ``Content-Length`` or chunked)
whose callbacks are ignored, then the bytes that followed; what comes after the body is the
next request, as on any connection.

The parser's refusals (bytes that are not HTTP: a malformed chunk, a control character in a
header; a URL past httptools' 65,535 bytes) were a plain-text 400 without a request id; they
are the JSON envelope here (414 for the URL), and the connection is closed as before.
"""

from __future__ import annotations

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_URL_BYTES = 0xFFFF  # httptools.parse_url takes no more (a 16-bit length)


def answer(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP response, the JSON error envelope, ``Connection: close``."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "code": code, "param": None}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class PlainHttpTools(HttpToolsProtocol):
    """Upgrades not taken are served as HTTP/1.1; the parser's refusals are JSON."""

    _framing_head = False  # a made-up head is being parsed: its callbacks change nothing

    def data_received(self, data: bytes) -> None:
        # uvicorn's, with the upgrade's offset kept (uvicorn drops it).
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("the request is not valid HTTP/1.1")
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():  # never with ws="none" (cli.py); kept for a WS server
                self.handle_websocket_upgrade()
            else:
                self._serve_without_upgrade(data[exc.args[0]:])

    def _serve_without_upgrade(self, rest: bytes) -> None:
        """The request whose head just ended asked for a protocol switch: serve it as it is."""
        self.logger.debug("ignoring Upgrade: %r", dict(self.headers).get(b"upgrade"))
        framing = self._framing()
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        if framing is not None:
            self.cycle.more_body = True  # llhttp called the message complete at its head
            self._framing_head = True
            self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        if rest:
            self.data_received(rest)

    def _framing(self) -> bytes | None:
        """The request's body framing as a header line, or None when it has no body."""
        codings = [v for k, v in self.headers if k == b"transfer-encoding"]
        if codings:
            return b"transfer-encoding: " + b", ".join(codings)
        lengths = [v for k, v in self.headers if k == b"content-length"]
        if lengths and lengths[0].strip() not in (b"", b"0"):
            return b"content-length: " + lengths[0].strip()
        return None

    def on_message_begin(self) -> None:
        if not self._framing_head:
            super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._framing_head:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._framing_head:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._framing_head:
            self._framing_head = False  # what follows is the request's own body
            return
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if len(self.url) > MAX_URL_BYTES:
            response = answer(414, "URI Too Long", "uri_too_long",
                              f"the request target is {len(self.url)} bytes, past "
                              f"{MAX_URL_BYTES}")
        else:
            response = answer(400, "Bad Request", "invalid_http", msg)
        self.transport.write(response)
        self.transport.close()
