"""The progress bar of `runtime data prepare`: bytes read of the inputs' total, documents,
tokens/s and ETA, on stderr (so `--json` stdout stays clean).

enabled=None (auto) shows it only when stderr is a terminal (tqdm's disable=None); a hidden bar
costs two integer additions per document and never sizes the inputs. The shown bar is redrawn
once per tokenizer batch (ENCODE_BATCH documents), at most every 0.1 s.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from jobspec.storage import url_to_fs


class PrepareProgress:
    """Counts what a prepare has read and written; shows it as one tqdm bar when enabled.

    files: the expanded inputs, read in this order; max_bytes: the prepare's cap (the total is
    min(sum of the file sizes, max_bytes)); bytes_known=False (rollout inputs, whose bytes the
    reader does not report) makes the bar count documents instead of bytes.
    """

    def __init__(
        self,
        files: list[str],
        max_bytes: int | None,
        enabled: bool | None,
        *,
        every: int,
        bytes_known: bool = True,
        file: TextIO | None = None,
    ):
        self.bytes = 0  # document bytes read (raised to the finished files' sizes as they end)
        self.documents = 0
        self.tokens = 0
        self.every = every
        self.bytes_known = bytes_known
        self._ends: list[int] = []  # cumulative file sizes: where the count stands as each ends
        self._files_done = 0
        self._bar = tqdm(
            desc="prepare",
            unit="B" if bytes_known else " docs",
            unit_scale=bytes_known,
            file=file if file is not None else sys.stderr,
            disable=None if enabled is None else not enabled,
            leave=True,
            dynamic_ncols=True,
        )
        self.shown = not self._bar.disable
        self._start = time.perf_counter()
        if self.shown and bytes_known:
            self._ends = _cumulative_sizes(files)
            if self._ends:
                total = self._ends[-1]
                self._bar.reset(total=total if max_bytes is None else min(total, max_bytes))
            self._start = time.perf_counter()

    def file_done(self) -> None:
        """One input file has been read to its end (its bytes beyond the documents' text, such
        as JSONL framing, count as read now)."""
        self._files_done += 1
        if self._ends:
            self.bytes = max(self.bytes, self._ends[self._files_done - 1])

    def wrote(self, tokens: int) -> None:
        """One document of `tokens` tokens went to a split; the bar is redrawn every `every`."""
        self.documents += 1
        self.tokens += tokens
        if self.shown and self.documents % self.every == 0:
            self._show()

    def close(self, complete: bool) -> None:
        """End the bar: a complete prepare has read everything (it stands at its total)."""
        if not self.shown:
            return
        if complete and self.bytes_known and self._bar.total is not None:
            self.bytes = self._bar.total
        self._show()
        self._bar.close()

    def _show(self) -> None:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        rate = tqdm.format_sizeof(self.tokens / elapsed)
        if self.bytes_known:
            self._bar.set_postfix_str(f"{self.documents} docs, {rate} tok/s", refresh=False)
            position = min(self.bytes, self._bar.total or self.bytes)
        else:
            self._bar.set_postfix_str(f"{rate} tok/s", refresh=False)
            position = self.documents
        self._bar.update(position - self._bar.n)


def _cumulative_sizes(files: list[str]) -> list[int]:
    """Running totals of the files' sizes (through fsspec: local or gs://, whose sizes the glob
    that found the files has usually cached); [] when one cannot be sized, as a bar must never
    fail a prepare (the read that follows reports the problem)."""
    ends: list[int] = []
    total = 0
    try:
        for uri in files:
            fs, path = url_to_fs(uri)
            total += int(fs.size(path) or 0)
            ends.append(total)
    except Exception:  # noqa: BLE001
        return []
    return ends
