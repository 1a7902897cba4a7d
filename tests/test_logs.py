"""Logging (bgeserve/logs.py): records written on a thread of their own, nothing lost or mixed."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading

import pytest

from bgeserve.logs import Background, JsonFormatter, RequestIdFilter, request_id_var


def _background(stream: io.StringIO) -> Background:
    target = logging.StreamHandler(stream)
    target.setFormatter(JsonFormatter())
    handler = Background(target)
    handler.addFilter(RequestIdFilter())
    return handler


def test_records_are_written_off_the_callers_thread_with_the_callers_request_id() -> None:
    """The request id comes from the caller's context (the writer thread has none), the
    message is merged, extras and the traceback arrive, and close() writes what is queued."""
    stream = io.StringIO()
    handler = _background(stream)
    log = logging.getLogger("bgeserve.test-logs")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    writers: set[str] = set()
    real_emit = handler.target.emit
    handler.target.emit = lambda r: (writers.add(threading.current_thread().name), real_emit(r))
    try:
        token = request_id_var.set("req-7")
        try:
            log.info("answered %d of %s", 3, "three", extra={"status": 200})
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        finally:
            request_id_var.reset(token)
        for i in range(200):
            log.info("line %d", i)
    finally:
        log.removeHandler(handler)
        handler.close()
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert len(lines) == 202
    first, second = lines[0], lines[1]
    assert first["msg"] == "answered 3 of three" and first["status"] == 200
    assert first["request_id"] == "req-7" and "request_id" not in lines[2]
    assert second["msg"] == "failed" and "ValueError: boom" in second["exc"]
    assert [x["msg"] for x in lines[2:]] == [f"line {i}" for i in range(200)]  # in order
    assert writers and threading.current_thread().name not in writers


def test_setup_logging_replaces_its_own_writer() -> None:
    """A second setup_logging (the CLI run twice in one process) stops the first writer
    thread instead of leaving it behind; only the server's logging has that thread."""
    from bgeserve.logs import setup_logging

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        setup_logging("json", background=True)
        first = root.handlers[0]
        assert isinstance(first, Background) and first.listener is not None
        setup_logging("json")
        assert first.listener is None and not isinstance(root.handlers[0], Background)
        root.handlers[0].close()
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


def test_records_go_to_the_stdout_of_the_moment(monkeypatch, capsys) -> None:
    """A stdout swapped and closed after setup_logging (pytest's capture, a host application)
    takes nothing: records go to the new stdout, and no "Logging error" reaches stderr."""
    from bgeserve.logs import setup_logging

    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr("sys.stdout", first)
        setup_logging("json")
        logging.getLogger("bgeserve.test-stdout").info("one")
        first.close()
        monkeypatch.setattr("sys.stdout", second)
        logging.getLogger("bgeserve.test-stdout").info("two")
        root.handlers[0].close()
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    assert [json.loads(x)["msg"] for x in second.getvalue().splitlines()] == ["two"]
    assert "Logging error" not in capsys.readouterr().err


def failed_record(message: str, error: str) -> logging.LogRecord:
    """An ERROR record of ``message`` carrying a ValueError(``error``)'s traceback."""
    try:
        raise ValueError(error)
    except ValueError:
        return logging.LogRecord("bgeserve", logging.ERROR, __file__, 1, message, None,
                                 sys.exc_info())


def test_text_lines_carry_the_extra_fields_json_lines_do() -> None:
    """BGE_M3_LOG_FORMAT=text: the heartbeat read "heartbeat" alone, its RSS, workers and
    queue only in JSON. The fields follow the message as key=value, the request id last, a
    traceback on its own lines."""
    from bgeserve.logs import TextFormatter

    record = logging.LogRecord("bgeserve", logging.INFO, __file__, 1, "heartbeat", None, None)
    record.__dict__.update({"rss_mb": 512, "workers": {"ready": 2}, "probe_status": "complete",
                            "note": "two words", "skipped": None, "request_id": "req-9"})
    line = TextFormatter().format(record)
    assert line.endswith('bgeserve: heartbeat rss_mb=512 workers={"ready":2} '
                         'probe_status=complete note="two words" [req-9]'), line
    text = TextFormatter().format(failed_record("failed", "boom"))
    assert text.splitlines()[0].endswith("bgeserve: failed") and "ValueError: boom" in text
    # uvicorn's colour copy of its message is no field; a value that would break the line or
    # its key=value reading is quoted; a dict keyed by numbers is still written
    odd = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started", None, None)
    odd.__dict__.update({"color_message": "Started \x1b[36m%d\x1b[0m", "path": "a\nb",
                         "eq": "k=v", "codes": {200: 3}})
    line = TextFormatter().format(odd)
    assert line.endswith('Started path="a\\nb" eq="k=v" codes={"200":3}'), line
    assert "\n" not in line and "color_message" not in line
    assert "color_message" not in JsonFormatter().format(odd)
    assert json.loads(JsonFormatter().format(odd))["codes"] == {"200": 3}


def test_text_lines_escape_what_clients_put_in_the_message() -> None:
    """The access line's message holds the request's path (decoded) and an error's field
    name, both the client's: a newline in them wrote a second line that read as a record of
    its own (QA: a forged ERROR line), an escape code reached the terminal. Escaped; the
    traceback keeps its lines; printable text (CJK, a tab-free line) is as it was."""
    from bgeserve.logs import TextFormatter

    forged = "/nope\n2026-12-06 16:41:02,000 ERROR   bgeserve.http: FORGED\x1b[31m\r\ud800"
    record = logging.LogRecord("bgeserve.http", logging.INFO, __file__, 1, "%s %s %d",
                               ("POST", forged, 404), None)
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line, line
    assert line.endswith(r"POST /nope\n2026-12-06 16:41:02,000 ERROR   bgeserve.http: "
                         r"FORGED\x1b[31m\r\ud800 404"), line
    plain = logging.LogRecord("bgeserve", logging.INFO, __file__, 1, "模型 ready %s", ("ok",),
                              None)
    assert TextFormatter().format(plain).endswith("bgeserve: 模型 ready ok")
    text = TextFormatter().format(failed_record("failed\tnow", "two\nlines"))
    assert text.splitlines()[0].endswith("bgeserve: failed\\tnow")
    assert "ValueError: two\nlines" in text


def test_a_log_whose_reader_went_away_ends_quietly(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``bgeserve serve | head -1``: once a write meets a broken pipe the records are dropped,
    not each answered by a 14-line "--- Logging error ---" on stderr; a stream closed before
    the start (``sys.stdout`` None: ``>&-``) is written nowhere."""
    from bgeserve.logs import LiveStream

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    handler = LiveStream("stdout")
    record = logging.LogRecord("bgeserve", logging.INFO, __file__, 1, "hello", None, None)
    monkeypatch.setattr(sys, "stdout", Broken())
    for _ in range(3):
        handler.emit(record)
    assert handler.gone is sys.stdout and capsys.readouterr().err == ""
    swapped = io.StringIO()  # another stream swapped in (a test's capture): written again
    monkeypatch.setattr(sys, "stdout", swapped)
    handler.emit(record)
    assert "hello" in swapped.getvalue()
    monkeypatch.setattr(sys, "stdout", None)
    LiveStream("stdout").emit(record)
    assert capsys.readouterr().err == ""
