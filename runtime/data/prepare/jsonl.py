"""JSONL input: the objects of a file (plain, .gz or .zst), one per non-empty line, with errors
that name the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jobspec.errors import DataError
from runtime.data.prepare.streams import input_lines


def json_objects(uri: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-empty line of the file at `uri` (local or gs://),
    decompressed as its suffix says (.gz, .zst) and read line by line."""
    for lineno, raw in input_lines(uri):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(
                f"line {lineno} of {uri} is not valid JSON ({e}); write one JSON object per line"
            ) from e
        if not isinstance(doc, dict):
            raise DataError(
                f"line {lineno} of {uri} is not a JSON object; write one JSON object per line"
            )
        yield lineno, doc
