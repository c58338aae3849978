"""JSONL input: the objects of a file, one per non-empty line, with errors that name the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jobspec.errors import DataError
from jobspec.storage import url_to_fs


def json_objects(uri: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-empty line of the file at `uri` (local or gs://)."""
    fs, path = url_to_fs(uri)
    with fs.open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
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
