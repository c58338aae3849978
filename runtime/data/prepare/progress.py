"""The progress bar of `runtime data prepare`: bytes read of the inputs' total, documents,
tokens/s and ETA, on stderr (so `--json` stdout stays clean).

enabled=None (auto) shows it only when stderr is a terminal (tqdm's disable=None); a hidden bar
costs a few integer additions per report. The shown bar is redrawn at most every 0.1 s; the
input sizes come from the listing that found the files.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class PrepareProgress:
    """Counts what a prepare has read and written; shows it as one tqdm bar when enabled.

    total_bytes: the input bytes this prepare reads (the sizes of its files, capped at max_bytes);
    None makes the bar count documents instead of bytes (rollout inputs, whose reader does not
    report bytes). Parts report through `add`, from this process or from a worker's queue.
    """

    def __init__(
        self,
        total_bytes: int | None,
        enabled: bool | None,
        *,
        file: TextIO | None = None,
    ):
        self.bytes = 0  # input bytes read (a compressed file's are counted at most its size)
        self.documents = 0
        self.tokens = 0
        self.files = 0
        self.bytes_known = total_bytes is not None
        self._bar = tqdm(
            desc="prepare",
            unit="B" if self.bytes_known else " docs",
            unit_scale=self.bytes_known,
            file=file if file is not None else sys.stderr,
            disable=None if enabled is None else not enabled,
            leave=True,
            dynamic_ncols=True,
        )
        self.shown = not self._bar.disable
        if self.shown and total_bytes is not None:
            self._bar.reset(total=total_bytes)
        self._start = self._drawn = time.perf_counter()

    def add(self, nbytes: int = 0, documents: int = 0, tokens: int = 0, files: int = 0) -> None:
        """What a part has done since its last report; the bar is redrawn at most every 0.1 s."""
        self.bytes += nbytes
        self.documents += documents
        self.tokens += tokens
        self.files += files
        if self.shown and (now := time.perf_counter()) - self._drawn >= 0.1:
            self._drawn = now
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
