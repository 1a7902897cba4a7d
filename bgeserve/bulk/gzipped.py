"""Input files opened for reading bytes, gzipped ones decompressed: a file cut short (a copy
or download that stopped) ends at its cut instead of raising, and says so (``cut_of``); one
damaged inside is refused before any model loads (``check``)."""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from bgeserve.errors import InvalidInput

log = logging.getLogger("bgeserve.bulk")
READ_BYTES = 1 << 20


class _Stream(io.RawIOBase):
    """A gzip file's decompressed bytes that end where the file does when it is cut short
    (``gzip`` raises EOFError there, and the job stopped on the file at every rerun, the rows
    read before it unwritten). ``cut`` then says why the row there is bad. With
    ``whole_lines``, what follows the last line break is held back until more comes, and
    dropped at a cut: a CSV line cut in its text would be a row with half its text. With
    ``quoted`` (CSV), a record's end is a line break (LF, or CR as old Macs wrote) outside a
    quoted value, as pyarrow reads them (``_Records``): a quoted value may hold line breaks,
    and one cut after them was a good row with half its text (review). Data damaged inside
    the stream (a CRC or deflate error) still raises."""

    def __init__(self, file: gzip.GzipFile, path: Path, whole_lines: bool, quoted: bool):
        super().__init__()
        self._file = file
        self._path = path
        self._whole_lines = whole_lines
        self._records = _Records() if quoted else None
        # Bytes after the last line break read (whole_lines), in the reads they came in: one
        # line of 100 MB joined to what was held at every read would be copied ~1,600 times.
        self._held: list[bytes] = []
        self._out = memoryview(b"")  # bytes ready for the reader
        self._ended = False
        self.cut: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out and not self._ended:
            self._fill(len(buffer))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]  # a view: no copy of what is left
        return n

    def _fill(self, size: int) -> None:
        try:
            # read1: one decompression at a time. read(n) gathers several into n bytes, and
            # the EOFError of a later one threw away what the earlier ones gave.
            data = self._file.read1(max(size, 1 << 16))
        except EOFError as exc:
            self._ended = True
            self.cut = (f"the gzip file ends here, cut short ({exc}): this row and any after it "
                        "are missing from the file")
            if self._path not in _WARNED:  # once, however many times the file is read
                _WARNED.add(self._path)
                log.warning("%s is cut short (%s): its rows before the cut are read (unchecked: "
                            "its CRC is at its end), the row where it ends is a bad row",
                            self._path, exc)
            return
        if not data:
            self._ended = True
            self._out, self._held = memoryview(b"".join(self._held)), []
            return
        if not self._whole_lines:
            self._out = memoryview(data)
            return
        end = self._records.end(data) if self._records else data.rfind(b"\n") + 1
        if not end and self._records and sum(map(len, self._held)) > HOLD_BYTES:
            # A quote that never closes (a malformed file): lines, as without quotes, so
            # what is held stays bounded; a cut inside it may then give a half row.
            end = data.rfind(b"\n") + 1
        if not end:  # no line break yet: held until one comes
            self._held.append(data)
            return
        self._out = memoryview(b"".join([*self._held, data[:end]]))
        self._held = [data[end:]]


HOLD_BYTES = 16 << 20  # what a CSV record may hold back before its lines are taken as records
_FIELD, _UNQUOTED, _QUOTED, _QUOTE, _CLOSED = range(5)
# What changes the state outside a quoted value: a line break, or a field that starts with a
# quote (a comma before any other field changes nothing: skipped, one search a line).
_TURNS = re.compile(rb'[\r\n]|,"')


class _Records:
    """Where CSV records end, read as pyarrow reads them, a read at a time: a '"' opens a
    quoted value only at a field's start (``5" screen`` is text), inside one ``""`` is a
    quote and another '"' closes it, after which the field runs to its comma or line break
    as text. (Counting every '"' took a stray inch mark for an open quote: the rest of the
    file was held back, and at a cut its rows lost: review.)"""

    def __init__(self) -> None:
        self._state = _FIELD

    def end(self, data: bytes) -> int:
        """Past the last line break in ``data`` that ends a record (0: none)."""
        last, i, n, state = 0, 0, len(data), self._state
        while i < n:
            if state == _FIELD:
                if data[i] == 0x22:
                    state, i = _QUOTED, i + 1
                else:
                    state = _UNQUOTED
            elif state == _QUOTED:
                j = data.find(b'"', i)
                if j < 0:
                    break
                state, i = _QUOTE, j + 1
            elif state == _QUOTE:  # a '"' in a quoted value: doubled, or the close
                state, i = (_QUOTED, i + 1) if data[i] == 0x22 else (_CLOSED, i)
            else:  # _UNQUOTED, _CLOSED: text to a line break or a quoted field's start
                found = _TURNS.search(data, i)
                if found is None:
                    if data[-1] == 0x2C:  # a comma last: the next read starts a field
                        state = _FIELD
                    break
                j = found.start()
                if data[j] == 0x2C:  # ',"'
                    state, i = _QUOTED, j + 2
                else:  # CR or LF: the record ends
                    last, state, i = j + 1, _FIELD, j + 1
        self._state = state
        return last


_WARNED: set[Path] = set()  # files said to be cut short


@contextlib.contextmanager
def open_bytes(path: Path, compressed: bool, whole_lines: bool = False, quoted: bool = False
               ) -> Iterator[io.BufferedIOBase]:
    """``path`` opened for reading bytes, decompressed if ``compressed`` (a ``_Stream`` under
    a buffer; ``whole_lines`` and ``quoted``: see there)."""
    if not compressed:
        with open(path, "rb") as f:
            yield f
        return
    try:
        with gzip.open(path, "rb") as gz, \
                io.BufferedReader(_Stream(gz, path, whole_lines, quoted)) as f:
            yield f
    except (OSError, EOFError, zlib.error) as exc:  # not gzip, or damaged inside
        raise InvalidInput(f"{path}: not a gzip file bgeserve can read ({exc})",
                           param="INPUT") from None


def cut_of(f: io.BufferedIOBase | None) -> str | None:
    """Why the row where ``f`` (from ``open_bytes``) was cut short is bad; None where it was
    not (or is not read to its end yet)."""
    raw = getattr(f, "raw", None)
    return raw.cut if isinstance(raw, _Stream) else None


def is_empty(path: Path) -> bool:
    """Whether gzipped ``path`` holds no bytes (a whole stream of none)."""
    try:
        with gzip.open(path, "rb") as f:
            return f.read(1) == b""
    except (OSError, EOFError, zlib.error):
        return False  # cut short or damaged: said when it is checked or read


def check(path: Path) -> None:
    """InvalidInput when gzipped ``path`` is no gzip or its data is damaged inside: its CRC
    tells only at its end, after the damaged rows were read (as text gone wrong, some of them
    embedded). Decompressing it once more costs seconds per GB; embedding it, hours. A file
    cut short passes: its whole rows are read, then one bad row (``_Stream``)."""
    try:
        with gzip.open(path, "rb") as f:
            while f.read(READ_BYTES):
                pass
    except EOFError:
        return
    except gzip.BadGzipFile as exc:
        with open(path, "rb") as f:
            magic = f.read(2)
        # gzip says "Not a gzipped file" at any member's start: bytes after a whole stream (an
        # error page appended to a download) are damage, not a file that is no gzip (review).
        if magic != b"\x1f\x8b":
            raise InvalidInput(f"{path}: not a gzip file ({exc}): name it without .gz if it is "
                               "not compressed", param="INPUT") from None
        raise InvalidInput(f"{path}: its gzip data is damaged ({exc}): copy the file again, "
                           "or leave it out of the inputs", param="INPUT") from None
    except (OSError, zlib.error) as exc:
        raise InvalidInput(f"{path}: its gzip data is damaged ({exc}): copy the file again, "
                           "or leave it out of the inputs", param="INPUT") from None
