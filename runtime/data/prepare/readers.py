"""Input files of `runtime data prepare` as documents: text, JSONL or parquet, plain or compressed.

Public API:
    TEXT_FIELD = "text"
    input_kind(uri) -> "text" | "jsonl" | "parquet"        by name
    compression_of(uri) -> "gzip" | "zstd" | None          by suffix (.gz, .zst, .zstd)
    read_documents(uri, text_field=TEXT_FIELD) -> Iterator[bytes]

Rules:
  * *.parquet is parquet; *.jsonl / *.ndjson, plain or .gz/.zst/.zstd, is JSONL; anything else
    is text (plain or compressed). Names are matched case-insensitively; local paths and gs://
    are read alike, through fsspec.
  * text: the whole decompressed file is one document (its raw bytes); an empty file gives none.
  * JSONL: one document per non-empty line, from its string field `text_field`.
  * parquet: one document per non-null value of the column `text_field` (string, large_string,
    string_view, their dictionary form, or binary, taken as raw bytes like a text file).
  * Everything streams: JSONL line by line through the decompressor, parquet one row group (in
    batches of that one column) at a time, so memory is bounded by one line or one row group's
    column, never the file. Parquet page checksums are verified where the writer stored them.
  * A mistake in an input (a missing file, corrupt or truncated compression, bad JSON, a missing
    or non-text field, a file that is not parquet, an undecodable row group) is one DataError
    sentence naming the file as given, the line or row group, and the fix. Storage faults (a
    full disk, a failing bucket) propagate as they are, for the caller to retry or report.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from jobspec.errors import DataError
from runfolder.storage import storage_fault
from runtime.data.prepare.jsonl import json_objects
from runtime.data.prepare.streams import (
    COMPRESSION_SUFFIXES,
    compression_of,
    open_decompressed,
    open_input,
    raise_read_error,
    short_reason,
)

__all__ = ["TEXT_FIELD", "compression_of", "input_kind", "read_documents"]

TEXT_FIELD = "text"
InputKind = Literal["text", "jsonl", "parquet"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TEXT_READ = 1 << 20  # bytes per read of a text document
_BATCH_ROWS = 1024  # parquet rows converted to Python at once
_ROLLOUT_KEYS = ("prompt", "prompt_ids", "completion_ids")


def input_kind(uri: str) -> InputKind:
    """What a file holds, by its name (see the module rules)."""
    name = uri.lower()
    if name.endswith(".parquet"):
        return "parquet"
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            break
    return "jsonl" if name.endswith(_JSONL_SUFFIXES) else "text"


def read_documents(uri: str, text_field: str = TEXT_FIELD) -> Iterator[bytes]:
    """The bytes of every document of one input file, in file order, streamed."""
    kind = input_kind(uri)
    if kind == "parquet":
        yield from _parquet_documents(uri, text_field)
    elif kind == "jsonl":
        yield from _jsonl_documents(uri, text_field)
    else:
        yield from _text_documents(uri)


# ---- text and JSONL --------------------------------------------------------------------------


def _text_documents(uri: str) -> Iterator[bytes]:
    chunks: list[bytes] = []
    size = 0
    with open_decompressed(uri) as f:
        while True:
            try:
                chunk = f.read(_TEXT_READ)
            except Exception as e:
                raise_read_error(uri, e, f"after {size} bytes of its text")
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if size:
        yield b"".join(chunks)


def _jsonl_documents(uri: str, text_field: str) -> Iterator[bytes]:
    for lineno, doc in json_objects(uri):
        text = doc.get(text_field)
        if not isinstance(text, str):
            raise DataError(_missing_field_message(uri, lineno, doc, text_field))
        yield text.encode("utf-8")


def _missing_field_message(uri: str, lineno: int, doc: dict[str, Any], field: str) -> str:
    what = f' ("{field}" is {_json_type(doc[field])})' if field in doc else ""
    head = f'line {lineno} of {uri} has no string "{field}" field{what}; '
    if any(k in doc for k in _ROLLOUT_KEYS):
        return (
            f'{head}give every line of a JSONL input a "{field}" string (it looks like a '
            "rollout: prepare it with --format rollouts)"
        )
    others = [k for k, v in doc.items() if isinstance(v, str) and k != field]
    if others:
        named = ", ".join(f'"{k}"' for k in others[:5]) + (", …" if len(others) > 5 else "")
        return (
            f"{head}pass --text-field with the field that holds the text (this line's string "
            f'fields are {named}), or give every line a "{field}" string'
        )
    return f'{head}give every line of a JSONL input a "{field}" string'


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else "an object"


# ---- parquet ---------------------------------------------------------------------------------


def _parquet_documents(uri: str, text_field: str) -> Iterator[bytes]:
    with open_input(uri) as raw:
        try:
            # Checksums are verified only for pages whose writer stored one: a corrupt page
            # then fails loudly instead of decoding into wrong text.
            pf = pq.ParquetFile(raw, page_checksum_verification=True)
        except (pa.ArrowException, OSError) as e:
            if storage_fault(e) is not None:
                raise
            raise DataError(
                f"{uri} is not a parquet file or its footer is corrupt ({short_reason(e)}); "
                "write it again with a parquet writer, or remove it from the inputs"
            ) from e
        _check_text_column(uri, pf.schema_arrow, text_field)
        for group in range(pf.num_row_groups):
            batches = pf.iter_batches(
                batch_size=_BATCH_ROWS, row_groups=[group], columns=[text_field], use_threads=False
            )
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as e:
                    if storage_fault(e) is not None:
                        raise
                    raise DataError(
                        f"row group index {group} of {uri} cannot be decoded "
                        f"({short_reason(e)}); the file is corrupt: write it again, or remove it "
                        "from the inputs"
                    ) from e
                for value in _as_bytes(batch.column(0)).to_pylist():
                    if value is not None:
                        yield value


def _is_text_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return any(
        check(t)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_string_view,
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_binary_view,
        )
    )


def _check_text_column(uri: str, schema: pa.Schema, field: str) -> None:
    names = schema.names
    if field not in names:
        shown = ", ".join(f'"{n}"' for n in names[:10]) + (", …" if len(names) > 10 else "")
        raise DataError(
            f'{uri} has no column "{field}" (its columns are {shown or "none"}); pass '
            "--text-field COLUMN to read the column that holds the text"
        )
    t = schema.field(field).type
    if not _is_text_type(t):
        raise DataError(
            f'column "{field}" of {uri} is {t}, not text; pass --text-field COLUMN with a '
            "string column, or write the text as strings"
        )


def _as_bytes(column: pa.Array) -> pa.Array:
    # A cast of string/binary kinds to large_binary reuses their data buffer: no text is copied.
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.large_binary())
