"""Logging: JSON lines when stdout is not a TTY (containers), readable text otherwise."""

from __future__ import annotations

import io
import logging
import logging.handlers
import queue
import sys
import time
from contextvars import ContextVar
from typing import TextIO

import orjson

# The current request's id (set by the HTTP layer's RequestContext), stamped on every record.
request_id_var: ContextVar[str | None] = ContextVar("bgeserve_request_id", default=None)

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# uvicorn's own lines carry their message again with terminal colours: not a field.
_HIDDEN = _STD | {"color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _HIDDEN and value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted by Background.prepare in the logging thread
            out["exc"] = record.exc_text
        return orjson.dumps(out, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


class TextFormatter(logging.Formatter):
    """A line a person reads: time, level, logger, message, then the ``extra`` fields JSON
    lines carry as ``key=value`` (the heartbeat's RSS, workers and queue were in JSON only:
    "heartbeat" alone), then the request id. A traceback follows on its own lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The message carries what clients send (the access line's path, a field's name in
        # an error): a decoded newline wrote a line of its own, which read as another record
        # (a forged ERROR), and escape codes reached the terminal. The traceback, added after
        # this, keeps its lines.
        record.message = _printable(record.message)
        text = super().formatMessage(record)
        extras = [f"{key}={_text_value(value)}" for key, value in vars(record).items()
                  if key not in _HIDDEN and key != "request_id" and value is not None]
        rid = getattr(record, "request_id", None)
        return " ".join([text, *extras, *([f"[{rid}]"] if rid else [])])


def _printable(text: str) -> str:
    """``text`` with every character that is not printable (newlines, escape codes, lone
    surrogates; the space kept) written as its Python escape: one line, nothing a terminal
    acts on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else
                   c.encode("unicode_escape").decode("ascii") for c in text)


def _text_value(value: object) -> str:
    """A field as ``key=value`` shows it: strings as they are, quoted (JSON) where they hold
    a space, a quote, an '=' or anything unprintable (a newline would split the line);
    numbers as written; anything else as its JSON."""
    if isinstance(value, str):
        plain = value and value.isprintable() and not any(c in value for c in ' "=')
        return value if plain else orjson.dumps(value).decode()
    if isinstance(value, bool | int | float):
        return str(value)
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


class RequestIdFilter(logging.Filter):
    """Stamp ``record.request_id`` from the current request (``None`` outside one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class LiveStream(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` (or ``sys.stderr``) is when a record is written, as
    the stdlib's last-resort handler does for stderr: whoever swaps it and closes the old one
    (pytest's capture, a notebook, a host application) gets no "I/O operation on closed
    file"."""

    def __init__(self, name: str = "stdout") -> None:
        logging.Handler.__init__(self)  # not StreamHandler's: it would bind today's stream
        self.name_of_stream = name
        self.gone: object = None  # the stream whose reader went away: dropped while current

    @property
    def stream(self) -> TextIO:
        stream: TextIO | None = getattr(sys, self.name_of_stream)
        # None: the descriptor was closed before Python started (``>&-``).
        return NOWHERE if stream is None or stream is self.gone else stream

    def handleError(self, record: logging.LogRecord) -> None:
        """A reader that went away (``bgeserve serve | head -1``) or a closed stream ends the
        log quietly: each record printed a 14-line "--- Logging error ---" block instead."""
        exc = sys.exc_info()[1]
        if isinstance(exc, BrokenPipeError | ConnectionResetError) or (
                isinstance(exc, ValueError) and "closed file" in str(exc)):
            self.gone = getattr(sys, self.name_of_stream)  # a stream swapped in is written
            return
        super().handleError(record)


class _Nowhere(io.StringIO):
    """A stream that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)


NOWHERE: TextIO = _Nowhere()


class Background(logging.handlers.QueueHandler):
    """Hands records to a thread that formats and writes them (stdlib's QueueListener).

    A write to stdout is a syscall that blocks while the reader of the pipe (a container
    runtime, a supervisor) lags: on the event loop, one per request, it was ~70 % of the
    loop's time for a request refused at once (py-spy, docs/reliability.md §3). Here the loop
    only copies the record. ``close`` (logging.shutdown, at exit) writes what is queued first.
    """

    def __init__(self, target: logging.Handler) -> None:
        super().__init__(queue.SimpleQueue())
        self.target = target
        self.listener: logging.handlers.QueueListener | None = logging.handlers.QueueListener(
            self.queue, target, respect_handler_level=True)
        self.listener.start()

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record with its message merged and its traceback as text (what crosses the
        thread must not hold frames), every ``extra`` field kept."""
        message = record.getMessage()
        # A shallow copy, as copy.copy makes (other handlers keep the original), at a third of
        # its cost: one record per request, on the event loop.
        copied = logging.LogRecord.__new__(type(record))
        copied.__dict__.update(record.__dict__)
        record = copied
        record.msg, record.args = message, None
        if record.exc_info:
            formatter = self.target.formatter or logging.Formatter()
            record.exc_text = formatter.formatException(record.exc_info)
            record.exc_info = None
        return record

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.stop()  # drains the queue, then joins the thread
        self.target.close()
        super().close()


def setup_logging(fmt: str = "auto", level: str = "info", *, background: bool = False,
                  stderr: bool = False) -> None:
    """Configure the root logger once (``fmt``: auto | json | text | pretty).

    ``background``: records are written by a thread of their own (``Background``; the server,
    whose event loop must not wait on stdout). The one-shot commands write them in place.
    ``stderr``: the log goes there (a command whose stdout is its answer: ``bgeserve prepare``
    prints the export's directory, which ``D=$(bgeserve prepare)`` must get alone)."""
    target = LiveStream("stderr" if stderr else "stdout")
    use_json = fmt == "json" or (fmt == "auto" and not target.stream.isatty())
    target.setFormatter(JsonFormatter() if use_json else TextFormatter())
    handler: logging.Handler = Background(target) if background else target
    handler.addFilter(RequestIdFilter())  # here: the request's context is the caller's thread
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, Background):
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # we log requests ourselves
