"""runtime.data.prepare.readers: the documents of text, JSONL and parquet inputs (plain, .gz, .zst),
streamed with bounded memory, and one DataError sentence naming the file for each bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from jobspec.errors import DataError
from runfolder.storage import url_to_fs
from runtime.data.prepare.jsonl import json_objects
from runtime.data.prepare.readers import TEXT_FIELD, compression_of, input_kind, read_documents

DOCS = ["first doc", "", "ünïcödé ✓", "line one\nline two"]


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _docs(uri: str, text_field: str = TEXT_FIELD) -> list[bytes]:
    return list(read_documents(uri, text_field))


def _error(uri: str, text_field: str = TEXT_FIELD) -> str:
    """The message of the one DataError reading `uri` raises; it must be one sentence."""
    with pytest.raises(DataError) as info:
        _docs(uri, text_field)
    message = str(info.value)
    assert uri in message and "\n" not in message and "Traceback" not in message, message
    assert ". " not in message and not message.endswith("."), message
    return message


def _parquet(path: Path, table: pa.Table, **kwargs) -> str:
    pq.write_table(table, path, **kwargs)
    return str(path)


def test_kind_and_compression_by_name() -> None:
    assert [
        input_kind(u)
        for u in ("a.parquet", "gs://b/x/A.PARQUET", "a.jsonl", "a.jsonl.gz", "a.jsonl.zst")
    ] == ["parquet", "parquet", "jsonl", "jsonl", "jsonl"]
    assert [input_kind(u) for u in ("a.ndjson", "a.ndjson.zstd", "a.txt", "a.txt.zst", "a")] == [
        "jsonl",
        "jsonl",
        "text",
        "text",
        "text",
    ]
    assert input_kind("a.json") == "text" and input_kind("a.jsonl.bz2") == "text"
    assert [compression_of(u) for u in ("a.gz", "a.jsonl.zst", "a.txt.zstd", "a.jsonl")] == [
        "gzip",
        "zstd",
        "zstd",
        None,
    ]


def test_text_is_one_document_plain_or_compressed(tmp_path: Path) -> None:
    body = "".join(f"line {i} ✓\n" for i in range(20_000)).encode()  # several reads' worth
    assert _docs(_write(tmp_path / "a.txt", body)) == [body]
    assert _docs(_write(tmp_path / "a.txt.zst", _zstd(body))) == [body]
    assert _docs(_write(tmp_path / "a.txt.gz", gzip.compress(body))) == [body]
    assert _docs(_write(tmp_path / "a.py", b"print(1)\n")) == [b"print(1)\n"]
    assert _docs(_write(tmp_path / "empty.txt", b"")) == []
    assert _docs(_write(tmp_path / "empty.txt.zst", _zstd(b""))) == []


def test_jsonl_documents_plain_gz_zst_and_custom_field(tmp_path: Path) -> None:
    data = _jsonl([{"text": d, "id": i} for i, d in enumerate(DOCS)]).replace(b"\n", b"\n\n", 1)
    want = [d.encode() for d in DOCS]
    assert _docs(_write(tmp_path / "a.jsonl", data)) == want
    assert _docs(_write(tmp_path / "a.jsonl.gz", gzip.compress(data))) == want
    assert _docs(_write(tmp_path / "a.jsonl.zst", _zstd(data))) == want
    assert _docs(_write(tmp_path / "a.ndjson.zstd", _zstd(data))) == want
    # Concatenated frames (pzstd, `cat a.zst b.zst`) are one stream.
    two = _write(tmp_path / "two.jsonl.zst", _zstd(data) + _zstd(data))
    assert _docs(two) == want + want
    body = _write(tmp_path / "b.jsonl", _jsonl([{"body": "x", "text": 1}, {"body": "y"}]))
    assert _docs(body, "body") == [b"x", b"y"]


def test_long_zstd_jsonl_streams_across_many_pieces(tmp_path: Path) -> None:
    rows = [{"text": f"doc {i} " + "x" * (i % 300)} for i in range(30_000)]
    uri = _write(tmp_path / "long.jsonl.zst", _zstd(_jsonl(rows)))
    assert _docs(uri) == [r["text"].encode() for r in rows]


def test_json_objects_reads_compressed_files(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "n": i} for i in range(3)]
    for name, data in (("r.jsonl.gz", gzip.compress(_jsonl(rows))), ("r.jsonl.zst", None)):
        uri = _write(tmp_path / name, data if data is not None else _zstd(_jsonl(rows)))
        assert list(json_objects(uri)) == [(i + 1, r) for i, r in enumerate(rows)]


def test_parquet_row_groups_nulls_and_string_kinds(tmp_path: Path) -> None:
    values = [f"doc {i}" if i % 7 else None for i in range(50)]  # nulls give no document
    want = [v.encode() for v in values if v is not None]
    table = pa.table({"id": list(range(50)), "text": values})
    uri = _parquet(tmp_path / "a.parquet", table, row_group_size=8)
    assert pq.ParquetFile(uri).num_row_groups == 7
    assert _docs(uri) == want
    for kind in (pa.large_string(), pa.string_view(), pa.binary(), pa.large_binary()):
        cast = pa.table({"body": pa.array(values, pa.string()).cast(kind)})
        assert _docs(_parquet(tmp_path / f"{kind}.parquet", cast), "body") == want, kind
    dictionary = pa.table({"text": pa.array(values).dictionary_encode()})
    assert _docs(_parquet(tmp_path / "dict.parquet", dictionary)) == want
    empty = pa.table({"text": pa.array([], pa.string())})
    assert _docs(_parquet(tmp_path / "empty.parquet", empty)) == []


def test_parquet_memory_is_one_row_group_not_the_file(tmp_path: Path) -> None:
    rows, groups, size = 100, 16, 5_000
    text = [f"{i:06d}".encode() * (size // 6) for i in range(rows * groups)]
    table = pa.table({"text": pa.array(text, pa.binary()), "other": pa.array(text, pa.binary())})
    uri = _parquet(
        tmp_path / "big.parquet",
        table,
        row_group_size=rows,
        use_dictionary=False,
        compression="none",
    )
    del table
    group_bytes = rows * size
    # A pool of its own gives the peak of just this read, transient buffers included.
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        count = sum(1 for _ in read_documents(uri))
    finally:
        pa.set_memory_pool(default)
    assert count == rows * groups
    # About one row group's column at a time (it is decoded while the raw bytes are held), never
    # the column of the whole file (16 groups) nor the other column.
    assert group_bytes <= pool.max_memory() <= 3 * group_bytes, (pool.max_memory(), group_bytes)


def test_jsonl_field_errors_name_the_line_and_the_fix(tmp_path: Path) -> None:
    rollout = _write(tmp_path / "r.jsonl", _jsonl([{"text": "a"}, {"prompt": "p"}]))
    assert _error(rollout) == (
        f'line 2 of {rollout} has no string "text" field; give every line of a JSONL input a '
        '"text" string (it looks like a rollout: prepare it with --format rollouts)'
    )
    other = _write(tmp_path / "o.jsonl.zst", _zstd(_jsonl([{"title": "t", "body": "b", "n": 1}])))
    assert _error(other) == (
        f'line 1 of {other} has no string "text" field; pass --text-field with the field that '
        'holds the text (this line\'s string fields are "title", "body"), or give every line a '
        '"text" string'
    )
    nulls = _write(tmp_path / "n.jsonl", _jsonl([{"text": None}]))
    assert _error(nulls) == (
        f'line 1 of {nulls} has no string "text" field ("text" is null); give every line of a '
        'JSONL input a "text" string'
    )
    bad = _write(tmp_path / "bad.jsonl.gz", gzip.compress(b'{"text": "a"}\n{"text": \n'))
    assert _error(bad).startswith(f"line 2 of {bad} is not valid JSON (")
    listed = _write(tmp_path / "list.jsonl", b"[1, 2]\n")
    assert _error(listed) == (
        f"line 1 of {listed} is not a JSON object; write one JSON object per line"
    )


def test_corrupt_and_truncated_compression(tmp_path: Path) -> None:
    data = _jsonl([{"text": f"document number {i}"} for i in range(50_000)])
    z, g = _zstd(data), gzip.compress(data)
    cut = _write(tmp_path / "cut.jsonl.zst", z[: len(z) // 2])
    message = _error(cut)
    assert message.startswith(f"{cut} is truncated: it ends inside a zstd frame (reading line ")
    assert message.endswith("); copy or compress it again")
    assert _error(_write(tmp_path / "cut.txt.zst", z[:-3])).endswith(
        "bytes of its text); copy or compress it again"
    )
    plain = _write(tmp_path / "plain.jsonl.zst", data)
    assert _error(plain) == (
        f"{plain} is not a valid zstd stream (zstd decompressor error: Unknown frame descriptor, "
        "reading line 1); compress it again with zstd, or drop the .zst suffix if it is not "
        "compressed"
    )
    gcut = _write(tmp_path / "cut.jsonl.gz", g[: len(g) // 2])
    assert _error(gcut).startswith(f"{gcut} is truncated: its gzip stream ends early (reading line")
    gplain = _write(tmp_path / "plain.jsonl.gz", data)
    assert _error(gplain).startswith(f"{gplain} is not a valid gzip file (Not a gzipped file")
    crc = bytearray(g)
    crc[-8] ^= 0xFF  # the trailer's CRC32: the data decodes, the check fails
    gcrc = _write(tmp_path / "crc.jsonl.gz", bytes(crc))
    assert "is not a valid gzip file (CRC check failed" in _error(gcrc)


def test_missing_and_unreadable_inputs(tmp_path: Path) -> None:
    for name in ("gone.txt", "gone.jsonl.zst", "gone.parquet"):
        uri = str(tmp_path / name)
        assert _error(uri) == f"input {uri} does not exist; fix the input path or glob"
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    assert _error(str(folder)).startswith(f"cannot open input {folder} (")


def test_parquet_errors_name_the_file_column_and_row_group(tmp_path: Path) -> None:
    table = pa.table({"id": list(range(40)), "body": [f"doc {i} " * 40 for i in range(40)]})
    uri = _parquet(tmp_path / "a.parquet", table, row_group_size=10)
    assert _error(uri) == (
        f'{uri} has no column "text" (its columns are "id", "body"); pass --text-field COLUMN '
        "to read the column that holds the text"
    )
    assert _error(uri, "id") == (
        f'column "id" of {uri} is int64, not text; pass --text-field COLUMN with a string '
        "column, or write the text as strings"
    )
    not_parquet = _write(tmp_path / "b.parquet", _jsonl([{"text": "a"}]))
    assert _error(not_parquet) == (
        f"{not_parquet} is not a parquet file or its footer is corrupt (Parquet magic bytes not "
        "found in footer); write it again with a parquet writer, or remove it from the inputs"
    )
    raw = Path(uri).read_bytes()
    cut = _write(tmp_path / "cut.parquet", raw[: len(raw) // 2])
    assert _error(cut).startswith(f"{cut} is not a parquet file or its footer is corrupt (")


@pytest.mark.parametrize("compression", ["none", "snappy"])
def test_parquet_corrupt_row_group_is_named(tmp_path: Path, compression: str) -> None:
    table = pa.table({"text": [f"document {i} " * 30 for i in range(40)]})
    # Uncompressed pages decode whatever bytes they hold: their CRC is what catches damage.
    uri = _parquet(
        tmp_path / "a.parquet",
        table,
        row_group_size=10,
        use_dictionary=False,
        compression=compression,
        write_page_checksum=True,
    )
    chunk = pq.ParquetFile(uri).metadata.row_group(2).column(0)
    raw = bytearray(Path(uri).read_bytes())
    # The chunk's one page ends it; its header (statistics included) comes first, unchecked.
    end = chunk.data_page_offset + chunk.total_compressed_size
    raw[end - 24 : end - 8] = b"\xff" * 16
    bad = _write(tmp_path / "bad.parquet", bytes(raw))
    message = _error(bad)
    assert message.startswith(f"row group index 2 of {bad} cannot be decoded ("), message
    assert message.endswith("); the file is corrupt: write it again, or remove it from the inputs")
    # The row groups before the bad one were read, in order, before the error.
    first = []
    with pytest.raises(DataError):
        for doc in read_documents(bad):
            first.append(doc)
    assert first == [t.encode() for t in table.column("text").to_pylist()[:20]]


@pytest.mark.gcs
def test_parquet_and_zstd_jsonl_on_gcs(gs_run_uri: str) -> None:
    fs, root = url_to_fs(gs_run_uri)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["a", None, "b", "c"]}), sink, row_group_size=2)
    fs.pipe_file(f"{root}/d.parquet", sink.getvalue().to_pybytes())
    fs.pipe_file(f"{root}/d.jsonl.zst", _zstd(_jsonl([{"text": "x"}, {"text": "y"}])))
    fs.pipe_file(f"{root}/cut.jsonl.zst", _zstd(_jsonl([{"text": "z" * 5000}] * 50))[:-10])
    assert _docs(f"{gs_run_uri}/d.parquet") == [b"a", b"b", b"c"]
    assert _docs(f"{gs_run_uri}/d.jsonl.zst") == [b"x", b"y"]
    assert "is truncated: it ends inside a zstd frame" in _error(f"{gs_run_uri}/cut.jsonl.zst")
    missing = f"{gs_run_uri}/none.parquet"
    assert _error(missing) == f"input {missing} does not exist; fix the input path or glob"
