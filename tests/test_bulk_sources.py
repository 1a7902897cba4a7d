"""``bgeserve.bulk.sources``: which files a job reads, and their rows with the reason a bad
row cannot be embedded (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bgeserve.bulk.sources import Source, check_columns, discover, read
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
