"""uvicorn's httptools protocol, answering an ``Upgrade`` request as the HTTP/1.1 request it is.

An HTTP/1.1 server may ignore ``Upgrade`` (RFC 9110 §7.8) and answer the request itself; curl's
``--http2`` on http://, Java's ``HttpClient`` and Spring's ``RestClient`` send ``Upgrade: h2c``
by default. llhttp, though, stops parsing at the end of such a request's head: it reports the
message complete without a body and hands back the bytes that follow as the new protocol's.
uvicorn then ran the request with an empty body (a valid POST answered 400 "empty document",
uvicorn#2722, httptools#124) and read the body as the next request's head. Here, when the
upgrade is not taken (bgeserve serves no WebSocket), the request gets its body back: a fresh
parser is given a head with the request's own framing (its ``Content-Length`` or
``Transfer-Encoding``) whose callbacks are ignored, then the bytes that followed.

The answer closes the connection (``Connection: close``): a proxy that starts tunnelling when
it sees ``Upgrade``, without waiting for a 101, would otherwise pass the client's next bytes
to this server as requests it never inspected (WebSocket smuggling). A client that asked for
h2c goes on over HTTP/1.1 on a new connection.
"""

from __future__ import annotations

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class PlainHttpTools(HttpToolsProtocol):
    """Upgrades not taken are served as HTTP/1.1, each on a connection closed after it."""

    _framing_head = False  # a made-up head is being parsed: its callbacks change nothing

    def data_received(self, data: bytes) -> None:
        # uvicorn's, with the upgrade's offset kept (uvicorn drops it); a loop, not a
        # recursion, over the requests of one read.
        self._unset_keepalive_if_required()
        view = memoryview(data)
        while True:
            try:
                self.parser.feed_data(view)
                return
            except httptools.HttpParserError as exc:
                # No warning of its own (uvicorn's had no client): the refusal's line says it
                # (headlimits.py), with the client's address.
                self.send_400_response(f"the request is not valid HTTP/1.1 ({exc})")
                return
            except httptools.HttpParserUpgrade as exc:
                if self._should_upgrade():  # never with ws="none" (cli.py); kept for WS
                    self.handle_websocket_upgrade()
                    return
                if not self._reframe():
                    return
                view = view[exc.args[0]:]
                if not view:
                    return

    def _reframe(self) -> bool:
        """The request whose head just ended asked for a protocol switch: a parser that reads
        its body next (False: its framing was refused, and answered so)."""
        self.logger.debug("ignoring Upgrade: %r", dict(self.headers).get(b"upgrade"))
        self.cycle.keep_alive = False  # nothing after it is read (the module's docstring)
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        framing = self._framing()
        if framing is None:
            return True
        self.cycle.more_body = True  # llhttp called the message complete at its head
        self._framing_head = True
        try:
            self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        except httptools.HttpParserError:  # llhttp checks the framing only past the head
            self._framing_head = False
            self.send_400_response("the request's Transfer-Encoding or Content-Length is not "
                                   "valid HTTP/1.1")
            return False
        return True

    def _framing(self) -> bytes | None:
        """The request's body framing as header lines, or None when it has no body."""
        lines = [name + b": " + value for name, value in self.headers
                 if name in (b"transfer-encoding", b"content-length")]
        return b"\r\n".join(lines) if lines else None

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
