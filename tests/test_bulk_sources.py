"""``bgeserve.bulk.sources`` and ``readers``: which files a job reads, and their rows with the
reason a bad row cannot be embedded (no model)."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bgeserve.bulk.readers import read
from bgeserve.bulk.sources import Source, check_columns, discover
from bgeserve.errors import InvalidInput


def rows_of(source: Source, text: str = "text", id_: str = "id"):
    parts = list(read(source, text, id_))
    return ([int(r) for p in parts for r in p.rows], [i for p in parts for i in p.ids],
            [t for p in parts for t in p.texts], [e for p in parts for e in p.errors])


def test_discover_takes_files_and_folders_once_skipping_hidden_and_the_output(tmp_path: Path):
    """Folders give their known files (sorted, recursively), hidden ones and the output folder
    left out; a file named twice is read once."""
    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ("b.jsonl", "a.parquet", "sub/c.csv", ".hidden.jsonl", "notes.txt"):
        (tmp_path / "in" / name).write_text("")
    (tmp_path / "in" / "out").mkdir()
    (tmp_path / "in" / "out" / "shard.parquet").write_text("")
    found = discover([tmp_path / "in", tmp_path / "in" / "b.jsonl"], exclude=tmp_path / "in" / "out")
    assert [(s.path.name, s.format) for s in found] == [
        ("a.parquet", "parquet"), ("b.jsonl", "jsonl"), ("c.csv", "csv")]


@pytest.mark.parametrize("make", ["missing", "unknown", "empty folder"])
def test_discover_refuses_what_it_cannot_read(tmp_path: Path, make: str):
    """A missing path, an unknown suffix or a folder without inputs is an error naming it."""
    target = tmp_path / "x.txt"
    if make == "unknown":
        target.write_text("")
    elif make == "empty folder":
        target = tmp_path / "empty"
        target.mkdir()
    with pytest.raises(InvalidInput, match=target.name):
        discover([target])


def test_jsonl_rows_are_numbered_by_line_and_bad_ones_say_why(tmp_path: Path):
    """Line numbers are row numbers (blank lines are no rows); a line that is not JSON, not an
    object, without a string text or without an id is a bad row with its reason."""
    lines = [json.dumps({"id": "a", "text": "one"}), "", json.dumps({"id": 7, "text": "two"}),
             "{not json", "[1, 2]", json.dumps({"id": "c", "text": 5}),
             json.dumps({"id": "d"}), json.dumps({"text": "no id"}),
             json.dumps({"id": 1.5, "text": "float id"})]
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows, ids, texts, errors = rows_of(Source(path, "jsonl"))
    assert rows == [0, 2, 3, 4, 5, 6, 7, 8]
    assert ids == ["a", "7", None, None, "c", "d", None, None]
    assert texts == ["one", "two", None, None, None, None, None, None]
    assert errors == [None, None, "not valid JSON", "not a JSON object",
                      "'text' is int, not a string", "no 'text'", "no 'id'",
                      "'id' is float, not a string or an integer"]


def test_a_long_integer_id_is_kept_whole_and_a_line_not_utf8_says_so(tmp_path: Path):
    """An integer id past 64 bits is its decimal digits (orjson read it as a float: "'id' is
    float", QA); a line in Latin-1 is "not valid UTF-8", not "not valid JSON"."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"id": 123456789012345678901234567890, "text": "big"}\n'
                     b'{"id": -18446744073709551617, "text": "big2"}\n'
                     + '{"id": "l", "text": "caf\u00e9"}\n'.encode("latin-1")
                     + b'{"id": 2e30, "text": "a float"}\n')
    rows, ids, texts, errors = rows_of(Source(path, "jsonl"))
    assert rows == [0, 1, 2, 3]
    assert ids == ["123456789012345678901234567890", "-18446744073709551617", None, None]
    assert texts == ["big", "big2", None, None]
    assert errors[:2] == [None, None]
    assert errors[2].startswith("not valid UTF-8 (byte 24 of the line")
    assert errors[3] == "'id' is float, not a string or an integer"


def test_a_json_file_holding_one_array_gives_its_items_as_rows(tmp_path: Path, caplog):
    """Most .json files are one array, not JSON lines: its items are the rows (row i the
    array's item i), bad ones saying why, whatever its layout (BOM, blank lines, pretty-printed,
    gzipped); it was one bad row "not a JSON object", 0 rows embedded and exit 0. One that
    starts with '[' but is no JSON is refused, naming the file."""
    import gzip

    from bgeserve.bulk.job import total_rows

    items = [{"id": "a", "text": "x"}, {"id": 2, "text": "y"}, 5, {"text": "no id"}]
    pretty = b"\xef\xbb\xbf\n  " + json.dumps(items, indent=2).encode()
    for name, data in (("a.json", json.dumps(items).encode()), ("b.json", pretty),
                       ("c.json.gz", gzip.compress(pretty))):
        (tmp_path / name).write_bytes(data)
        source = Source(tmp_path / name, "jsonl")
        assert rows_of(source) == ([0, 1, 2, 3], ["a", "2", None, None], ["x", "y", None, None],
                                   [None, None, "not a JSON object", "no 'id'"]), name
    assert total_rows([Source(tmp_path / "b.json", "jsonl")]) is None  # not its lines
    # No array after all (JSON lines whose first is an array, a '}' closing nothing), or a
    # .jsonl file: read line by line, each bad line a bad row; nothing stops the job.
    (tmp_path / "lines.json").write_text('[1, 2]\n{"id": "b", "text": "y"}\n')
    (tmp_path / "brace.json").write_text('[1}\n{"id": "b", "text": "y"}\n')
    (tmp_path / "lines.jsonl").write_text(json.dumps(items) + '\n{"id": "b", "text": "y"}\n')
    for name, why in (("lines.json", "not a JSON object"), ("brace.json", "not valid JSON"),
                      ("lines.jsonl", "not a JSON object")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
            assert rows_of(Source(tmp_path / name, "jsonl")) == (
                [0, 1], [None, "b"], [None, "y"], [why, None]), name
        # where a .json file stopped being one array is said, not only its lines' errors
        said = " ".join(r.getMessage() for r in caplog.records)
        assert {"lines.json": "more after the array's end at byte 7",
                "brace.json": "a '}' closing nothing at byte 2", "lines.jsonl": ""}[name] in said
        assert ("starts as a JSON array" in said) == name.endswith(".json"), (name, said)
    assert rows_of(Source(tmp_path / "a.json", "jsonl"))[0] == [0, 1, 2, 3]  # as an array


@pytest.mark.parametrize("layout", ["one line", "an item a line", "pretty"])
def test_a_json_array_cut_short_gives_its_whole_items(layout, tmp_path: Path, caplog):
    """An array whose file ends before it does (a copy that stopped): its whole items are
    rows, then the item it ends with where that is whole (only the ']' missing), else one bad
    row saying the file ends there. Read as JSON lines it lost every row (an item a line: each
    line ends in a comma; pretty-printed: no line is an object)."""
    items = [{"id": f"r{i}", "text": f"text {i}"} for i in range(4)]
    if layout == "one line":
        data = json.dumps(items)
    elif layout == "an item a line":
        data = "[\n" + ",\n".join(json.dumps(x) for x in items) + "\n]\n"
    else:
        data = json.dumps(items, indent=2)
    last = data.rindex("{")  # where the last item starts
    whole = data[:data.rindex("}") + 1]  # the ']' alone missing
    cases = {"mid": (data[:last + 12], 3, "the file ends here"),  # inside the last item
             "comma": (data[:data.rindex(",") + 1], 3, "the file ends here"),
             "bracket": (whole, 4, None)}
    for case, (cut, good, why) in cases.items():
        path = tmp_path / f"{case}.json"
        path.write_text(cut)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
            rows, ids, texts, errors = rows_of(Source(path, "jsonl"))
        n = good + (why is not None)
        assert rows == list(range(n)), case
        assert ids[:good] == [x["id"] for x in items[:good]]
        assert texts[:good] == [x["text"] for x in items[:good]]
        assert errors[:good] == [None] * good
        if why is not None:
            assert ids[good] is None and why in errors[good] and "cut short" in errors[good]
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "is a JSON array cut short" in said and "its whole items (3) are read, then " \
            f"{'one bad row' if why else 'the item it ends with'}" in said, (case, said)


def test_a_json_array_is_read_an_item_at_a_time(tmp_path: Path, monkeypatch):
    """A .json array is streamed, not read whole (a file of a few GB took several times its
    size in memory); its items keep what the line reader gives them: a lone surrogate keeps
    the row's id and says why, a number with a fraction is a float as orjson says."""
    import tracemalloc

    from bgeserve.bulk import readers

    monkeypatch.setattr(readers, "READ_ROWS", 256)
    monkeypatch.setattr(readers, "ARRAY_READ_BYTES", 1 << 16, raising=False)
    path = tmp_path / "big.json"
    items = [{"id": i, "text": f"{i} " + "x" * 1000} for i in range(8000)]
    path.write_bytes(json.dumps(items).encode())
    size = path.stat().st_size
    tracemalloc.start()
    try:
        n = 0
        for piece in read(Source(path, "jsonl"), "text", "id"):
            assert piece.texts[0] == items[n]["text"] and piece.ids[-1] == str(n + len(piece) - 1)
            n += len(piece)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == len(items) and peak < size / 4, (peak, size)

    (tmp_path / "odd.json").write_text('[{"id": "s", "text": "\\ud800 lone"}, {"id": 1.5, '
                                       '"text": "x"}, {"id": "t", "text": 2e400}, '
                                       '{"id": "e", "text": "\\ud83d\\ude00"}]')
    rows, ids, texts, errors = rows_of(Source(tmp_path / "odd.json", "jsonl"))
    assert rows == [0, 1, 2, 3] and ids == ["s", None, "t", "e"] and texts[3] == "\U0001f600"
    assert errors[0] is not None and "lone surrogate (U+D800" in errors[0]
    assert errors[1:] == ["'id' is float, not a string or an integer",
                          "'text' is float, not a string", None]


@pytest.mark.parametrize("read_bytes", [1, 2, 3, 7, 1 << 20])
def test_a_json_array_is_cut_at_its_own_commas_whatever_its_strings_hold(read_bytes, monkeypatch):
    """The array is cut into items outside strings and nested values only, however the reads
    fall (an escape, a quote, a multi-byte character split between two): each item is the
    JSON the whole file holds there. A file that is not one array whole is refused."""
    import io

    import orjson

    from bgeserve.bulk import readers

    monkeypatch.setattr(readers, "ARRAY_READ_BYTES", read_bytes)
    items = [{"id": "a,b]", "text": 'x\\"}, {"'}, [1, [2, {"a": "]"}]], "\\", 'q"', "",
             {"t": "é中😀\u2028\n\\\\", "n": None}, 3.5, {}, [], True, "\\\""]
    for data in (json.dumps(items).encode(), b"\xef\xbb\xbf \n" + json.dumps(items, indent=1).encode()
                 + b"\n\n", json.dumps(items, ensure_ascii=True).encode()):
        got = [orjson.loads(b) for b in readers._item_bytes(io.BytesIO(data))]
        assert got == items
    cut = lambda data: list(readers._item_bytes(io.BytesIO(data)))
    assert cut(b" [ ] ") == [] and cut(b"[1,]") == [b"1", b""] and cut(b'["a" "b"]') == [b'"a" "b"']
    for bad in (b"", b"  ", b"[1] 2", b"[1]]", b"[1", b'["a]', b"x[1]", b"[1}", b"{}", b"[1,\n"):
        with pytest.raises(readers._NotOneArray):
            cut(bad)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab ,:[]{}"\\/\n\té中😀\u2028')),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet='a,]"\\', max_size=3), inner, max_size=3), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(_JSON, max_size=6), read_bytes=st.integers(1, 9), indent=st.booleans(),
       ascii_only=st.booleans())
def test_any_json_array_is_cut_into_its_items(items, read_bytes, indent, ascii_only):
    """Whatever the array holds and however the reads fall, its items are cut where the JSON
    says (orjson parsing the whole file is the reference)."""
    import io

    import orjson

    from bgeserve.bulk import readers

    data = json.dumps(items, indent=1 if indent else None, ensure_ascii=ascii_only).encode()
    old, readers.ARRAY_READ_BYTES = readers.ARRAY_READ_BYTES, read_bytes
    try:
        got = [orjson.loads(b) for b in readers._item_bytes(io.BytesIO(data))]
    finally:
        readers.ARRAY_READ_BYTES = old
    assert got == orjson.loads(data)


def test_a_lone_surrogate_line_keeps_its_id_and_says_why(tmp_path: Path):
    """JSON allows an escaped lone surrogate, which orjson refuses: the row was "not valid
    JSON" with no id; now it keeps its id and the reason names the character."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "b13", "text": "\\ud800 lone"}\n{"id": "ok", "text": "fine"}\n'
                    '{"id": "b\\ud800", "text": "x"}\n')
    rows, ids, texts, errors = rows_of(Source(path, "jsonl"))
    # an id holding one is written escaped: the bad-row report is UTF-8 (it crashed the job)
    assert rows == [0, 1, 2] and ids == ["b13", "ok", "b\\ud800"]
    assert texts == [None, "fine", None]
    assert errors[0] is not None and "lone surrogate (U+D800" in errors[0] and errors[1] is None
    assert errors[2] is not None and errors[2].startswith("id holds a lone surrogate")


def test_parquet_and_csv_rows_are_read_as_strings_with_nulls_bad(tmp_path: Path):
    """Parquet ids (int or string) and CSV cells come back as strings; a null (CSV: empty)
    text is a bad row; a Parquet text column that is not strings makes every row bad."""
    pq.write_table(pa.table({"id": [1, 2, None], "text": ["a", None, "c"]}), tmp_path / "p.parquet")
    assert rows_of(Source(tmp_path / "p.parquet", "parquet")) == (
        [0, 1, 2], ["1", "2", None], ["a", None, None], [None, "no 'text'", "no 'id'"])
    (tmp_path / "c.csv").write_text('id,text,other\n001,"x, y",1\n2,,2\n3,"multi\nline",3\n')
    assert rows_of(Source(tmp_path / "c.csv", "csv")) == (
        [0, 1, 2], ["001", "2", "3"], ["x, y", None, "multi\nline"], [None, "no 'text'", None])
    pq.write_table(pa.table({"id": ["a"], "text": [5]}), tmp_path / "n.parquet")
    assert rows_of(Source(tmp_path / "n.parquet", "parquet"))[3] == ["'text' is int64, not a string"]


def test_a_missing_column_fails_before_any_row_naming_the_flag(tmp_path: Path):
    """CSV and Parquet files lacking the text or id column are refused up front."""
    pq.write_table(pa.table({"key": [1], "text": ["a"]}), tmp_path / "p.parquet")
    with pytest.raises(InvalidInput, match="--id-column"):
        check_columns(Source(tmp_path / "p.parquet", "parquet"), "text", "id")
    (tmp_path / "c.csv").write_text("id,body\n1,a\n")
    with pytest.raises(InvalidInput, match="--text-column"):
        check_columns(Source(tmp_path / "c.csv", "csv"), "text", "id")
    check_columns(Source(tmp_path / "c.csv", "csv"), "body", "id")


def _csv_oracle(data: bytes) -> tuple[list[int], list, list, list]:
    """What the stdlib's csv module reads from ``data`` (id,text): each record's number,
    and its cells or why it is bad, the way read() is expected to report them."""
    import csv
    import io

    records = list(csv.reader(io.TextIOWrapper(io.BytesIO(data), "utf-8", "surrogateescape",
                                               newline="")))[1:]
    rows, ids, texts, errors = [], [], [], []
    for n, cells in enumerate(records):
        rows.append(n)
        if len(cells) != 2:  # its id named all the same, as read (it was None: QA)
            ids.append(cells[0] if cells and cells[0] else None), texts.append(None)
            errors.append(f"expected 2 cells, found {len(cells)}")
            continue
        utf8 = [not any("\udc80" <= ch <= "\udcff" for ch in c) for c in cells]
        # An empty cell is a missing value (no quoted "" is written here).
        error = ("'id' is not valid UTF-8" if not utf8[0] else "'text' is not valid UTF-8"
                 if not utf8[1] else "no 'id'" if not cells[0] else "no 'text'"
                 if not cells[1] else None)
        ids.append(cells[0] if utf8[0] and cells[0] else None)
        texts.append(cells[1] if error is None else None)
        errors.append(error)
    return rows, ids, texts, errors


@pytest.mark.parametrize("block", [4 << 20, 1000, 200])
def test_csv_bytes_that_are_not_utf8_and_lines_with_other_cell_counts_are_bad_rows(
        tmp_path: Path, block: int, monkeypatch: pytest.MonkeyPatch):
    """A cell that is not UTF-8 or a line with too many or too few cells is one bad row in its
    place, numbered as the stdlib's csv reader counts records, and the rows after it keep
    theirs, across read blocks too (both stopped the whole job: pyarrow's reader raised), as
    does a quoted text over lines that a block ends inside (pyarrow's chunker split it)."""
    import random

    from bgeserve.bulk import readers

    monkeypatch.setattr(readers, "CSV_BLOCK_BYTES", block)
    rnd = random.Random(7)
    lines = [b"id,text"]
    for i in range(300):
        kind = rnd.random()
        if kind < 0.1:
            lines.append(b"%d,caf\xe9 %d" % (i, i))  # Latin-1, not UTF-8
        elif kind < 0.15:
            lines.append(b"\xff%d,fine text" % i)  # the id is not UTF-8
        elif kind < 0.25:
            lines.append(b"%d,one,two" % i)
        elif kind < 0.3:
            lines.append(b"%d" % i)
        elif kind < 0.33:
            lines.append(b"%d," % i)  # no text
        elif kind < 0.45:  # a quoted text over lines (and over a block's end)
            lines.append(b'%d,"a quoted\n%s\nline, with a comma"' % (i, b"x" * rnd.randrange(90)))
        else:
            lines.append(f"{i},text número {i}".encode())
    data = b"\n".join(lines) + b"\n"
    path = tmp_path / "mixed.csv"
    path.write_bytes(data)
    got = rows_of(Source(path, "csv"))
    want = _csv_oracle(data)
    assert got[0] == want[0] and got[3] == want[3]
    assert got[1] == want[1] and got[2] == want[2]
    assert {e for e in got[3] if e} == {"'text' is not valid UTF-8", "'id' is not valid UTF-8",
                                        "expected 2 cells, found 3", "expected 2 cells, found 1",
                                        "no 'text'"}


def test_a_csv_line_with_other_cell_counts_names_its_id_wherever_the_column_is(
        tmp_path: Path) -> None:
    """The id cell of a malformed line, counted from the side away from the text (whose
    unquoted commas make extra cells), gzipped too: the warning said "id None" (QA); where a
    cell is missing after the text, which one is not known."""
    import gzip

    data = b'text,note,ref\n"a, b",n,r0\nunquoted, comma,n,r1\nc,n\n"d\ne",x,n,r3\n'
    (tmp_path / "a.csv").write_bytes(data)
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(data))
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + data)  # the first name's BOM dropped
    for name in ("a.csv", "a.csv.gz", "bom.csv"):
        _, ids, texts, errors = rows_of(discover([str(tmp_path / name)])[0], "text", "ref")
        assert ids == ["r0", "r1", None, "r3"], name
        assert texts == ["a, b", None, None, None]
        assert errors[1:] == ["expected 3 cells, found 4", "expected 3 cells, found 2",
                              "expected 3 cells, found 4"]


def test_an_empty_csv_has_no_rows_and_a_header_only_one_neither(tmp_path: Path):
    """A 0-byte CSV is read as no rows, as an empty JSONL is (it stopped a folder's job with
    pyarrow's "Empty CSV file", naming no file); a header alone has no rows either."""
    empty, header = tmp_path / "empty.csv", tmp_path / "header.csv"
    empty.write_bytes(b"")
    header.write_text("id,text\n")
    for path in (empty, header):
        check_columns(Source(path, "csv"), "text", "id")
        assert rows_of(Source(path, "csv")) == ([], [], [], [])


def test_a_file_that_is_not_csv_or_parquet_is_refused_naming_it(tmp_path: Path):
    """A .parquet that is not Parquet is an error naming the file, not pyarrow's bare one."""
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(InvalidInput, match="broken.parquet"):
        check_columns(Source(path, "parquet"), "text", "id")


def test_a_parquet_row_group_damaged_in_a_page_is_bad_rows_and_the_next_is_read(
        tmp_path: Path, caplog):
    """Its footer reads, a data page of the second of three row groups does not: that group's
    rows are bad rows saying so, and the groups around it are read. (pyarrow's bare "Corrupt
    snappy compressed data." stopped the job at every rerun, blamed on --output: QA.)"""
    path = tmp_path / "damaged.parquet"
    texts = [f"text {i} " * 20 for i in range(3000)]
    pq.write_table(pa.table({"id": list(range(3000)), "text": texts}), path, row_group_size=1000)
    meta = pq.read_metadata(path).row_group(1).column(1)  # the texts of rows 1000-1999
    start = meta.dictionary_page_offset or meta.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start + 100:start + 2100] = bytes(2000)  # zeros inside that column chunk's pages
    path.write_bytes(bytes(raw))
    check_columns(Source(path, "parquet"), "text", "id")  # the footer is whole
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        rows, ids, got, errors = rows_of(Source(path, "parquet"))
    assert rows == list(range(3000))  # every row accounted for, in order
    good = [*range(1000), *range(2000, 3000)]
    assert [got[i] for i in good] == [texts[i] for i in good]
    assert [ids[i] for i in good] == [str(i) for i in good]
    assert all(errors[i] is None for i in good)
    assert all(got[i] is None and errors[i] and "damaged part of the file (row group 1" in errors[i]
               for i in range(1000, 2000))
    assert ids[1000:2000] == [str(i) for i in range(1000, 2000)]  # its ids read whole
    assert "rows 1000-1999 (row group 1) cannot be read" in caplog.text


def test_a_parquet_page_whose_checksum_fails_is_bad_rows_not_text_gone_wrong(tmp_path: Path):
    """Uncompressed pages decode whatever their bytes: where the writer put checksums, they
    are verified (QA: a flipped byte was embedded as altered text, silently)."""
    path = tmp_path / "sums.parquet"
    texts = [f"text {i} " * 20 for i in range(1500)]
    pq.write_table(pa.table({"id": list(range(1500)), "text": texts}), path,
                   row_group_size=500, compression="none", write_page_checksum=True,
                   use_dictionary=False)
    meta = pq.read_metadata(path).row_group(2).column(1)
    raw = bytearray(path.read_bytes())
    raw[meta.data_page_offset + 3000] ^= 0x01  # inside a text: still a string, one letter off
    path.write_bytes(bytes(raw))
    rows, ids, got, errors = rows_of(Source(path, "parquet"))
    assert rows == list(range(1500)) and got[:1000] == texts[:1000]
    assert all(e and "row group 2" in e for e in errors[1000:]) and got[1000:] == [None] * 500
    assert ids[1000:] == [str(i) for i in range(1000, 1500)]


def _gzip_cut(raw: bytes, keep: float) -> tuple[bytes, int]:
    """``raw`` gzipped, then cut to ``keep`` of its compressed bytes (a copy that stopped),
    and how many whole lines the cut file still holds (all that zlib gets out of it)."""
    import gzip
    import zlib

    data = gzip.compress(raw, mtime=0)
    cut = data[:int(len(data) * keep)]
    return cut, zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")


def _json_lines(n: int) -> bytes:
    return b"".join(json.dumps({"id": i, "text": f"row {i} " + "word " * (i % 40)}).encode()
                    + b"\n" for i in range(n))


def test_a_gzipped_jsonl_cut_short_gives_its_whole_rows_then_one_bad_row(tmp_path: Path,
                                                                         caplog):
    """A .jsonl.gz whose copy stopped: every whole line before the cut is its row, exactly as
    in the file; the line it ends in is one bad row saying so, with a warning naming the file
    (gzip's EOFError stopped the job at every rerun, the rows read before it unwritten)."""
    raw = _json_lines(3000)
    lines = raw.splitlines()
    path = tmp_path / "cut.jsonl.gz"
    data, n = _gzip_cut(raw, 0.6)  # n: whole rows in it
    path.write_bytes(data)
    source = discover([path])[0]
    check_columns(source, "text", "id")  # cut short is no damage: the job goes on
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        rows, ids, texts, errors = rows_of(source)
    assert 1000 < n < 3000 and rows == list(range(n + 1))
    assert texts[:n] == [json.loads(line)["text"] for line in lines[:n]]
    assert ids[:n] == [str(i) for i in range(n)] and errors[:n] == [None] * n
    assert texts[n] is None and ids[n] is None
    assert errors[n].startswith("the gzip file ends here, cut short")
    assert "cut.jsonl.gz is cut short" in caplog.text


@pytest.mark.parametrize("indent", [None, 1])
def test_a_gzipped_json_array_cut_short_gives_its_whole_items(tmp_path: Path, indent):
    """A .json.gz array cut short, minified (one line) or pretty-printed: its whole items,
    then one bad row where it ends."""
    items = [{"id": i, "text": f"item {i} " * 5} for i in range(2000)]
    path = tmp_path / "cut.json.gz"
    data, _ = _gzip_cut(json.dumps(items, indent=indent).encode(), 0.5)
    path.write_bytes(data)
    rows, ids, texts, errors = rows_of(discover([path])[0])
    n = len(rows) - 1
    assert 500 < n < 2000 and rows == list(range(n + 1))
    whole = zlib.decompressobj(wbits=31).decompress(data)
    assert whole.count(b"},") == n  # every item the cut file holds whole is read
    assert texts[:n] == [item["text"] for item in items[:n]] and errors[:n] == [None] * n
    assert ids[:n] == [str(i) for i in range(n)]
    assert errors[n] == "the file ends here, before its array does (cut short?)"


def test_a_gzipped_csv_cut_short_gives_no_half_row(tmp_path: Path):
    """A .csv.gz cut short: every whole line before the cut is its row (pyarrow's "Truncated
    compressed stream" stopped the job); the line cut in its text is no row with half its
    text but one bad row, after the malformed rows before it."""
    body = "id,text\n" + "".join(f"{i},row {i} {'word ' * (i % 50)}\n" if i != 7 else "7\n"
                                  for i in range(20000))
    lines = body.splitlines()[1:]
    path = tmp_path / "cut.csv.gz"
    data, n = _gzip_cut(body.encode(), 0.7)
    n -= 1  # the header's line
    path.write_bytes(data)
    source = discover([path])[0]
    check_columns(source, "text", "id")
    rows, ids, texts, errors = rows_of(source)
    assert 5000 < n < 20000 and rows == list(range(n + 1))
    assert errors[7] == "expected 2 cells, found 1"
    good = [i for i in range(n) if i != 7]
    assert [texts[i] for i in good] == [lines[i].split(",", 1)[1] for i in good]
    assert [ids[i] for i in good] == [str(i) for i in good]
    assert all(errors[i] is None for i in good)
    assert errors[n].startswith("the gzip file ends here, cut short") and texts[n] is None


def test_a_gzipped_csv_cut_inside_its_header_is_one_bad_row_and_an_empty_one_none(
        tmp_path: Path):
    """Cut before its header ends, a .csv.gz has no columns to check: one bad row where it
    ends, as a .jsonl.gz cut as early (it stopped the job, exit 2: "Empty CSV file", QA); a
    gzipped file of no bytes has no rows, as a 0-byte .csv."""
    import gzip

    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(gzip.compress(b"id,text\n" + b"1,one\n" * 5000, mtime=0)[:15])
    source = discover([cut])[0]
    check_columns(source, "text", "id")
    rows, ids, texts, errors = rows_of(source)
    assert (rows, ids, texts) == ([0], [None], [None])
    assert errors[0].startswith("the gzip file ends here, cut short")
    empty = tmp_path / "empty.csv.gz"
    empty.write_bytes(gzip.compress(b""))
    check_columns(discover([empty])[0], "text", "id")
    assert rows_of(discover([empty])[0]) == ([], [], [], [])


def test_a_file_reached_twice_through_a_link_is_read_once_and_linked_folders_are_named(
        tmp_path: Path, caplog):
    """Named and found through a symbolic link in a folder named: one source (QA: embedded
    twice); a linked folder, which the walk does not go into, is named in a warning."""
    (tmp_path / "data").mkdir()
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    target = tmp_path / "data" / "ids.jsonl"
    target.write_text('{"id": "a", "text": "x"}\n')
    (tmp_path / "tree" / "link.jsonl").symlink_to(target)
    (tmp_path / "tree" / "sub" / "b.jsonl").write_text('{"id": "b", "text": "y"}\n')
    (tmp_path / "tree" / "sublink").symlink_to(tmp_path / "tree" / "sub")
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        found = discover([tmp_path / "tree", target])
    assert [s.path.name for s in found] == ["link.jsonl", "b.jsonl"]
    assert "not read inside 1 linked folders (sublink)" in caplog.text


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
def test_a_gzipped_csv_cut_inside_a_quoted_value_with_line_breaks_gives_no_half_row(
        tmp_path: Path, ending: str):
    """Quoted values holding line breaks (and doubled quotes), lines ended as Unix, Windows
    or old Macs end them: wherever the file is cut, the rows before the record it is cut in
    are read whole, and that record is the one bad row (review: cut after a line break
    inside a value, the row was good with half its text, and the cut counted one row on)."""
    import gzip

    texts = [f'row {i} says ""hi""{ending}second line {i}{ending}third' for i in range(3000)]
    body = (f"id,text{ending}"
            + "".join(f'{i},"{t}"{ending}' for i, t in enumerate(texts))).encode()
    data = gzip.compress(body, mtime=0)
    path = tmp_path / "quoted.csv.gz"
    for keep in (0.31, 0.5, 0.77, 0.9):
        path.write_bytes(data[:int(len(data) * keep)])
        rows, ids, got, errors = rows_of(Source(path, "csv"))
        n = len(rows) - 1
        assert 100 < n < 3000 and rows == list(range(n + 1)), keep
        assert got[:n] == [t.replace('""', '"') for t in texts[:n]] and errors[:n] == [None] * n
        assert ids[:n] == [str(i) for i in range(n)]
        assert errors[n].startswith("the gzip file ends here, cut short") and got[n] is None
        whole = zlib.decompressobj(wbits=31).decompress(data[:int(len(data) * keep)])
        record = lambda i: f'{i},"{texts[i]}"{ending}'.encode()
        assert record(n - 1) in whole and record(n) not in whole  # the first one not whole


def test_a_quote_inside_an_unquoted_field_is_text_as_pyarrow_reads_it(tmp_path: Path,
                                                                      monkeypatch):
    """A '"' opens a quoted value only at a field's start (``5" screen`` is text): counted as a
    quote, one stray inch mark held the rest of the file back and, cut, lost its rows (review).
    Whole or cut, every row is read as pyarrow reads the plain file; a quote that never
    closes holds back at most HOLD_BYTES before lines are taken as records."""
    import gzip

    import pyarrow.csv as pacsv

    from bgeserve.bulk import gzipped

    body = ("id,text\n" + "".join(
        f'{i},"quoted ""{i}""\nover two lines"\n' if i % 7 == 0 else
        f'{i},a {i}" screen\n' if i == 3 else f"{i},plain {i}\n"  # one stray quote: odd
        for i in range(30000))).encode()
    plain = tmp_path / "plain.csv"
    plain.write_bytes(body)
    want = pacsv.read_csv(plain).column("text").to_pylist()
    assert want[3] == 'a 3" screen' and want[7] == 'quoted "7"\nover two lines'
    data = gzip.compress(plain.read_bytes(), mtime=0)
    path = tmp_path / "stray.csv.gz"
    path.write_bytes(data)
    assert rows_of(Source(path, "csv"))[2] == want
    for keep in (0.25, 0.5, 0.75):
        path.write_bytes(data[:int(len(data) * keep)])
        rows, _, got, errors = rows_of(Source(path, "csv"))
        n = len(rows) - 1
        assert n > 30000 * keep * 0.9 and got[:n] == want[:n] and errors[:n] == [None] * n
        assert errors[n].startswith("the gzip file ends here, cut short")
    monkeypatch.setattr(gzipped, "HOLD_BYTES", 100_000)
    path.write_bytes(gzip.compress(b'id,text\n1,"never closed\n' + b"2,x\n" * 200_000))
    with gzipped.open_bytes(path, True, whole_lines=True, quoted=True) as f:
        reads = list(iter(lambda: f.read1(1 << 16), b""))
    assert sum(map(len, reads)) == 24 + 800_000 and max(map(len, reads)) < 300_000


@pytest.mark.parametrize("name", ["damaged.jsonl.gz", "damaged.csv.gz"])
def test_gzip_data_damaged_inside_is_refused_before_the_model_loads(tmp_path: Path, name):
    """Damage inside the deflate data shows only at the end (its CRC), after rows of text gone
    wrong were read: the file is refused by the check every file gets before the model loads,
    naming it and what to do."""
    import gzip

    body = (b"id,text\n" + b"".join(b"%d,row %d\n" % (i, i) for i in range(20000))
            if name.endswith(".csv.gz") else _json_lines(3000))
    data = bytearray(gzip.compress(body, mtime=0))
    data[len(data) // 2] ^= 0x10  # one bit flipped
    path = tmp_path / name
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match=f"{name}: its gzip data is damaged .*copy the file"):
        check_columns(discover([path])[0], "text", "id")
    # Bytes after a whole stream (an error page appended to a download): damage too, not "not
    # a gzip file" (which gzip says at a member's start: review).
    path.write_bytes(gzip.compress(body, mtime=0) + b"<html>oops</html>")
    with pytest.raises(InvalidInput, match=f"{name}: its gzip data is damaged"):
        check_columns(discover([path])[0], "text", "id")


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_utf8_byte_order_mark_starts_no_bad_row(tmp_path: Path, suffix: str):
    """Files saved by Windows tools begin with a BOM: the first row is still read (JSONL's
    first line was "not valid JSON")."""
    path = tmp_path / f"bom.{suffix}"
    body = '{"id": "a", "text": "x"}\n' if suffix == "jsonl" else "id,text\na,x\n"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    check_columns(Source(path, suffix), "text", "id")
    assert rows_of(Source(path, suffix)) == ([0], ["a"], ["x"], [None])


@pytest.mark.parametrize("kind", ["dictionary", "large_string", "string_view"])
def test_encoded_string_columns_are_read_as_their_strings(tmp_path: Path, kind: str):
    """A pandas Categorical (dictionary), large_string or string_view text and id column is
    read as the strings it holds (every row was bad: "'text' is dictionary<...>")."""
    ids, texts = pa.array(["a", "b", "a"]), pa.array(["x", None, "z"])
    if kind == "dictionary":
        ids, texts = ids.dictionary_encode(), texts.dictionary_encode()
    else:
        target = pa.large_string() if kind == "large_string" else pa.string_view()
        ids, texts = ids.cast(target), texts.cast(target)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ids, "text": texts}), path)
    if kind == "string_view":  # Parquet reads it back as string: test the reader's input
        from bgeserve.bulk.readers import _columns

        part = _columns(pa.table({"id": ids, "text": texts}), Source(path, "parquet"), 0,
                        "text", "id")
        got = ([int(r) for r in part.rows], part.ids, part.texts, part.errors)
    else:
        got = rows_of(Source(path, "parquet"))
    assert got == ([0, 1, 2], ["a", "b", "a"], ["x", None, "z"], [None, "no 'text'", None])


def test_a_dictionary_of_integer_ids_gives_decimal_ids(tmp_path: Path):
    """Dictionary-encoded integer ids are ids, as plain integer ids are (Parquet reads them
    back plain: the reader's input is tested)."""
    from bgeserve.bulk.readers import _columns

    table = pa.table({"id": pa.array([7, 8]).dictionary_encode(), "text": ["x", "y"]})
    part = _columns(table, Source(tmp_path / "t.parquet", "parquet"), 0, "text", "id")
    assert part.ids == ["7", "8"] and part.errors == [None, None]


def test_an_empty_parquet_file_has_no_rows(tmp_path: Path):
    """A 0-byte .parquet is read as no rows, as an empty JSONL or CSV is (it stopped the whole
    job with pyarrow's "Parquet file size is 0 bytes", naming no file)."""
    from bgeserve.bulk.job import total_rows

    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    source = Source(path, "parquet")
    check_columns(source, "text", "id")
    assert rows_of(source) == ([], [], [], [])
    assert total_rows([source]) == 0


def test_gzipped_jsonl_and_csv_are_read_like_the_plain_files(tmp_path: Path):
    """``a.jsonl.gz`` and ``b.csv.gz`` are inputs, named or found in a folder; their rows are
    numbered as in the decompressed file, so resuming works as for the plain file."""
    import gzip

    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write('{"id": "a", "text": "x"}\n\n{"id": "b"}\n')
    with gzip.open(tmp_path / "b.csv.gz", "wt") as f:
        f.write("id,text\nc,y\n")
    found = discover([tmp_path])
    assert [(s.path.name, s.format) for s in found] == [("a.jsonl.gz", "jsonl"),
                                                        ("b.csv.gz", "csv")]
    assert discover([tmp_path / "a.jsonl.gz"]) == found[:1]
    for s in found:
        check_columns(s, "text", "id")
    assert rows_of(found[0]) == ([0, 2], ["a", "b"], ["x", None], [None, "no 'text'"])
    assert rows_of(found[1]) == ([0], ["c"], ["y"], [None])


def test_a_gz_file_that_is_not_gzip_is_refused_naming_it(tmp_path: Path):
    """A .jsonl.gz that is not gzip is an error naming the file, not an OSError."""
    (tmp_path / "bad.jsonl.gz").write_bytes(b"plain text\n")
    with pytest.raises(InvalidInput, match="bad.jsonl.gz"):
        rows_of(discover([tmp_path / "bad.jsonl.gz"])[0])
    with pytest.raises(InvalidInput, match="bad.jsonl.gz: not a gzip file .*name it without .gz"):
        check_columns(discover([tmp_path / "bad.jsonl.gz"])[0], "text", "id")


def test_files_of_no_known_format_in_a_folder_are_named_in_a_warning(tmp_path: Path, caplog):
    """A folder's files that are not read (a.tsv, b.jsonl.bz2) are named, not skipped
    silently; a parquet.gz is no format either."""
    for name in ("a.tsv", "b.jsonl.bz2", "c.parquet.gz", "d.jsonl"):
        (tmp_path / name).write_text("")
    with caplog.at_level(logging.WARNING, logger="bgeserve.bulk"):
        found = discover([tmp_path])
    assert [s.path.name for s in found] == ["d.jsonl"]
    assert "skipped 3 files" in caplog.text
    for name in ("a.tsv", "b.jsonl.bz2", "c.parquet.gz"):
        assert name in caplog.text


def test_a_gzipped_line_longer_than_many_reads_comes_whole_and_a_cut_one_not_at_all(
        tmp_path: Path):
    """Lines are held back across reads until their line break comes (held as the reads
    they came in: joined at each read, one 100 MB line was copied ~1,600 times); at a cut,
    the line it ends in is dropped and said."""
    import gzip

    from bgeserve.bulk import gzipped

    lines = [b"a" * 300_000 + b"\n", b"short\n", b"b" * 200_000 + b"\n", b"c" * 150_000]
    whole = tmp_path / "whole.gz"
    whole.write_bytes(gzip.compress(b"".join(lines), mtime=0))
    with gzipped.open_bytes(whole, True, whole_lines=True) as f:
        assert list(f) == lines and gzipped.cut_of(f) is None  # the last, unended, kept
    cut = tmp_path / "cut.gz"
    data = gzip.compress(b"".join(lines), mtime=0)
    cut.write_bytes(data[:-20])  # inside the last line's deflate data, or its trailer
    with gzipped.open_bytes(cut, True, whole_lines=True) as f:
        assert list(f) == lines[:3]
        assert (gzipped.cut_of(f) or "").startswith("the gzip file ends here, cut short")
