"""Record sources: the rows (tokens, loss mask, segments, positions, fields) of given record ids.

A record is one row of seq_len+1 tokens (inputs = row[:-1], targets = row[1:]).
  FixedWindows    record i = stream tokens [i*T, i*T + T + 1); N = (L - 1) // T records
  PackedDocuments record e*N + i = window i of epoch e's documents, permuted from (seed, e) and
                  concatenated (data.order = document_buffer)
  RolloutRows     record i = rollout i, one per row and never cut (see prepare/rollouts.py)

Rows (numpy, shape ids.shape + [seq_len]): inputs int32, targets int32, loss_mask float32
(1 = counted), segment_ids int32 (1, 2, … per document within a row), positions int32 (0 at the
row start and at every document start). FixedWindows rows are one segment with loss_mask 1
everywhere. PackedDocuments masks the target of each document's last token (the join into the
next document). A rollout of L tokens fills row positions 0..L-2 (inputs its tokens 0..L-2,
targets 1..L-1, segment 1); the rest is padding (inputs and targets 0, segment 0, loss_mask 0).
Its loss_mask is the rollout's (1 on completion targets) and `fields` adds the requested
per-token float32 arrays ("advantages", "old_logprobs") of the targets, 0 on padding.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from jobspec.errors import DataError
from jobspec.run_config import is_remote
from runfolder.storage import url_to_fs, with_retries
from runtime.data.manifest import Manifest, read_offsets
from runtime.data.order import DOCUMENT_STREAM, EpochCache, permutation

Rows = dict[str, np.ndarray]


class TokenStream:
    """Random access to a split's tokens (or, with `field`, to one of its per-token fields):
    np.memmap locally, fsspec range reads on gs://."""

    def __init__(self, manifest: Manifest, split: str, field: str | None = None):
        s = manifest.split(split)
        shards = s.shards if field is None else s.fields[field].shards  # type: ignore[index]
        dtype = manifest.token_dtype if field is None else s.fields[field].dtype  # type: ignore[index]
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.length = s.tokens
        self.starts = np.cumsum([0] + [sh.tokens for sh in shards], dtype=np.int64)
        self._uris = [manifest.uri_of(sh.path) for sh in shards]
        self.remote = is_remote(manifest.root)
        self._files: list[Any] = [None] * len(self._uris)
        self._lock = threading.Lock()

    def _open(self, i: int) -> Any:
        if self._files[i] is None:
            with self._lock:
                if self._files[i] is None:
                    fs, path = url_to_fs(self._uris[i])
                    # A plain ndarray view of the map: slicing it skips np.memmap's Python hooks.
                    self._files[i] = (
                        (fs, path)
                        if self.remote
                        else np.memmap(path, dtype=self.dtype, mode="r").view(np.ndarray)
                    )
        return self._files[i]

    def _slice(self, i: int, lo: int, hi: int) -> np.ndarray:
        f = self._open(i)
        if self.remote:
            fs, path = f
            size = self.dtype.itemsize
            data = with_retries(
                lambda: fs.cat_file(path, start=lo * size, end=hi * size), f"read {self._uris[i]}"
            )
            return np.frombuffer(data, dtype=self.dtype)
        return f[lo:hi]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's concatenated stream (may span shards)."""
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"token range [{start}, {stop}) is outside [0, {self.length})")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[i + 1]))
            base = int(self.starts[i])
            parts.append(self._slice(i, start - base, end - base))
            start, i = end, i + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] windows of the stream; local windows inside one shard are one
        fancy-index gather per shard, the rest (shard crossers, gs://) are read one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        if self.remote:
            return self._read_remote_windows(starts, length)
        out = np.empty((len(starts), length), self.dtype)
        first = np.searchsorted(self.starts, starts, side="right") - 1
        last = np.searchsorted(self.starts, starts + length - 1, side="right") - 1
        single = (first == last) & (not self.remote)
        for k in np.unique(first[single]):
            sel = np.flatnonzero(single & (first == k))
            local = starts[sel] - self.starts[k]
            out[sel] = self._open(int(k))[local[:, None] + np.arange(length)]
        for r in np.flatnonzero(~single):
            out[r] = self.read(int(starts[r]), int(starts[r]) + length)
        return out

    def _read_remote_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """All windows' byte ranges in one concurrent request batch (fsspec cat_ranges: gcsfs
        sends them at once), so a step costs about one round trip, not one per row."""
        if any(not 0 <= s <= s + length <= self.length for s in starts.tolist()):
            raise IndexError(f"a window of {length} tokens is outside [0, {self.length})")
        size = self.dtype.itemsize
        paths, lo, hi, where = [], [], [], []  # where: (row, column) each piece lands at
        for r, start in enumerate(starts.tolist()):
            pos, stop = start, start + length
            i = int(np.searchsorted(self.starts, pos, side="right")) - 1
            while pos < stop:
                end = min(stop, int(self.starts[i + 1]))
                base = int(self.starts[i])
                paths.append(self._open(i)[1])
                lo.append((pos - base) * size)
                hi.append((end - base) * size)
                where.append((r, pos - start))
                pos, i = end, i + 1
        out = np.empty((len(starts), length), self.dtype)
        if not paths:
            return out
        fs = self._open(0)[0]
        pieces = with_retries(
            lambda: fs.cat_ranges(paths, lo, hi, on_error="raise"),
            f"read {len(paths)} token ranges of {self._uris[0].rsplit('/', 1)[0]}/",
        )
        for (r, col), data in zip(where, pieces, strict=True):
            piece = np.frombuffer(data, dtype=self.dtype)
            out[r, col : col + len(piece)] = piece
        return out


class RecordSource(Protocol):
    """The records of one split: how many an epoch holds, and the rows of given record ids."""

    records_per_epoch: int
    remote: bool  # reads go over the network (gs://)
    field_names: list[str]  # the per-token fields its manifest stores (describe())

    def read(self, ids: np.ndarray) -> Rows:
        """The rows of `ids` (any shape), each array shaped ids.shape + [seq_len]."""
        ...


def _split_rows(tokens: np.ndarray, layout: Rows) -> Rows:
    """inputs/targets from [..., T+1] token rows, then the row layout arrays."""
    return {
        "inputs": np.ascontiguousarray(tokens[..., :-1]),
        "targets": np.ascontiguousarray(tokens[..., 1:]),
        **layout,
    }


class FixedWindows:
    """Record i is the token stream's window [i*T, i*T + T + 1): one segment, all counted."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int):
        self.seq_len = seq_len
        self.stream = TokenStream(manifest, split)
        self.remote = self.stream.remote
        self.field_names: list[str] = []
        self.records_per_epoch = (self.stream.length - 1) // seq_len
        if self.records_per_epoch < 1:
            hint = " (data.prepare.val_fraction > 0 fills it)" if split == "validation" else ""
            raise DataError(
                f"the {split} split of {manifest.root} has {self.stream.length} tokens but one row "
                f"needs seq_len+1 = {seq_len + 1}; lower training.seq_len or prepare more data{hint}"
            )
        self._layout = {
            "loss_mask": np.ones(seq_len, np.float32),
            "segment_ids": np.ones(seq_len, np.int32),
            "positions": np.arange(seq_len, dtype=np.int32),
        }

    def read(self, ids: np.ndarray) -> Rows:
        T, shape = self.seq_len, ids.shape
        tokens = np.empty(shape + (T + 1,), np.int32)
        tokens[...] = self.stream.read_windows(ids.ravel() * T, T + 1).reshape(tokens.shape)
        layout = {k: np.broadcast_to(v, shape + (T,)).copy() for k, v in self._layout.items()}
        return _split_rows(tokens, layout)


class PackedDocuments(FixedWindows):
    """Record e*N + i is window i of epoch e's documents, permuted from (seed, e) and packed."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int, seed: int):
        super().__init__(manifest, split, seq_len)
        self.seed = seed
        offsets = read_offsets(manifest, split)
        self._doc_starts, self._doc_lens = offsets[:-1], np.diff(offsets)
        self._docs = EpochCache(self._doc_epoch)

    def _doc_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        perm = permutation(self.seed, epoch, DOCUMENT_STREAM, len(self._doc_lens))
        ends = np.cumsum(self._doc_lens[perm], dtype=np.int64)
        return perm, np.concatenate([[0], ends])

    def read(self, ids: np.ndarray) -> Rows:
        shape, T = ids.shape, self.seq_len
        out = {
            "tokens": np.empty(shape + (T + 1,), np.int32),
            "loss_mask": np.ones(shape + (T,), np.float32),
            "segment_ids": np.empty(shape + (T,), np.int32),
            "positions": np.empty(shape + (T,), np.int32),
        }
        for idx in np.ndindex(shape):
            self._read_row(int(ids[idx]), {k: v[idx] for k, v in out.items()})
        return _split_rows(
            out["tokens"], {k: out[k] for k in ("loss_mask", "segment_ids", "positions")}
        )

    def _read_row(self, rid: int, row_out: Rows) -> None:
        """Fill one row's tokens, segment_ids, positions and loss_mask (views) for record rid."""
        T = self.seq_len
        epoch, row = divmod(rid, self.records_per_epoch)
        perm, cum = self._docs.get(epoch)
        pos, stop = row * T, row * T + T + 1
        j = int(np.searchsorted(cum, pos, side="right")) - 1
        tokens, seg, posn = row_out["tokens"], row_out["segment_ids"], row_out["positions"]
        mask = row_out["loss_mask"]
        seg_id = 0
        while pos < stop:
            d, doc_lo, doc_hi = int(perm[j]), int(cum[j]), int(cum[j + 1])
            end = min(stop, doc_hi)
            a, b = pos - row * T, end - row * T  # piece's span within the row
            src = int(self._doc_starts[d]) + pos - doc_lo
            tokens[a:b] = self.stream.read(src, src + b - a)
            seg_id += 1
            bi = min(b, T)  # inputs cover row positions 0..T-1
            seg[a:bi] = seg_id
            posn[a:bi] = np.arange(bi - a)
            if end == doc_hi and b <= T:
                # The doc's last token would predict the next doc: a synthetic join.
                mask[b - 1] = 0.0
            pos, j = end, j + 1


class RolloutRows:
    """Record i is rollout i, left-aligned in its own row; the rest of the row is padding."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int, fields: tuple[str, ...]):
        self.seq_len, self.fields = seq_len, tuple(fields)
        self.stream = TokenStream(manifest, split)
        self.remote = self.stream.remote
        self.field_names = ["loss_mask", *self.fields]
        offsets = read_offsets(manifest, split)
        self._doc_starts, self._doc_lens = offsets[:-1], np.diff(offsets)
        self.records_per_epoch = len(self._doc_lens)
        check_rollouts_fit(manifest, split, seq_len, int(self._doc_lens.max(initial=0)))
        self._field_streams = {f: TokenStream(manifest, split, f) for f in self.field_names}
        if self.records_per_epoch < 1:
            raise DataError(
                f"the {split} split of {manifest.root} holds no rollouts; prepare more rollouts"
                + (" or set data.prepare.val_fraction > 0" if split == "validation" else "")
            )

    def read(self, ids: np.ndarray) -> Rows:
        """A rollout of L tokens fills positions 0..L-2: inputs are its tokens 0..L-2 and targets,
        loss mask and fields are those of its tokens 1..L-1 (a field belongs to its target)."""
        shape = ids.shape + (self.seq_len,)
        out = {
            "inputs": np.zeros(shape, np.int32),
            "targets": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32),
            "segment_ids": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
            **{f: np.zeros(shape, np.float32) for f in self.fields},
        }
        for idx in np.ndindex(ids.shape):
            self._read_row(int(ids[idx]), {k: v[idx] for k, v in out.items()})
        return out

    def _read_row(self, d: int, row_out: Rows) -> None:
        lo, n = int(self._doc_starts[d]), int(self._doc_lens[d]) - 1
        tokens = self.stream.read(lo, lo + n + 1)
        row_out["inputs"][:n] = tokens[:-1]
        row_out["targets"][:n] = tokens[1:]
        row_out["segment_ids"][:n] = 1
        row_out["positions"][:n] = np.arange(n)
        for f, stream in self._field_streams.items():
            row_out[f][:n] = stream.read(lo + 1, lo + n + 1)


def record_source(
    manifest: Manifest, split: str, seq_len: int, order: str, seed: int, fields: tuple[str, ...]
) -> RecordSource:
    """The source for a manifest layout and data.order (check_order has refused the bad pairs)."""
    if manifest.layout == "rollouts":
        return RolloutRows(manifest, split, seq_len, fields)
    if order == "document_buffer":
        return PackedDocuments(manifest, split, seq_len, seed)
    return FixedWindows(manifest, split, seq_len)


def check_rollouts_fit(manifest: Manifest, split: str, seq_len: int, longest: int) -> None:
    """A row holds one whole rollout: L tokens make L - 1 predictions."""
    if longest - 1 > seq_len:
        raise DataError(
            f"the longest rollout in the {split} split of {manifest.root} has {longest} tokens, "
            f"so it needs {longest - 1} predictions but a row holds training.seq_len = {seq_len}; "
            f"raise training.seq_len to at least {longest - 1} (rollouts are never cut)"
        )
