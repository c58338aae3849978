"""The training data loader: one global batch order, each process reading only its own rows.

Public API:
    TokenBatches(manifest, split, seq_len, global_batch_size, accum=1, order="shuffle", seed=0,
                 process_index=0, process_count=1, prefetch=2, fields=())
        .iterate(start_step=0, stop_step=None) -> BatchIterator   Grain-backed, prefetching
        .read_step(step) -> dict[str, np.ndarray]                 this process's arrays, no Grain
        .record_ids(step) -> np.ndarray                           the step's R global record ids
        .provenance(step) -> dict                                 {"step", "record_ids", "batch_hash"}
        .state_for(step) -> dict                                  iterator state before `step`
        .describe() -> dict; .close()                             diagnostics; close its iterators
        .local_record_ids(step) -> np.ndarray                     [accum, local_rows] of this process
        .records_per_epoch, .rows_per_step, .local_rows
    BatchIterator: yields StepBatch(step, batch, provenance); get_state() / set_state(state);
        close(); a context manager
    train_batches(manifest, data: DataConfig, training: TrainingConfig, seed, process_index,
                  process_count) -> TokenBatches             the builder from a run config
    eval_loader(manifest, split, seq_len, global_batch_size, process_index=0, process_count=1,
                prefetch=2) -> TokenBatches                 the fixed eval order (sequential, accum 1)
    eval_batches(manifest, split, seq_len, global_batch_size, num_batches, process_index=0,
                 process_count=1, prefetch=2) -> BatchIterator     = eval_loader(…).iterate(0, n)
    check_for_run(manifest, data: DataConfig, vocab_size, training=None)   the start-of-run checks:
        check_tokenizer, check_vocab, check_order and (with training) check_objective + seq_len
    OBJECTIVE_FIELDS[objective]                               per-token fields the objective reads
    check_vocab(manifest, vocab_size) / check_tokenizer(manifest, spec)   start-of-run checks
    TokenStream(manifest, split).read(start, stop)            the split's concatenated token stream

Records. A record is one row of seq_len+1 tokens (inputs = row[:-1], targets = row[1:]); a split
of L tokens has N = (L - 1) // seq_len records per epoch. The infinite global sequence G wraps
epochs: sample n is row i = n % N of epoch e = n // N.
  sequential      record i = stream tokens [i*T, i*T + T + 1); record id i
  shuffle         the same records, permuted per epoch from (seed, e); record id = the record index
  document_buffer documents permuted per epoch from (seed, e), concatenated, cut the same way;
                  record id = e*N + i (the seed and id fix the tokens)
Step s uses global rows j = 0..R-1 (R = global_batch_size × accum) = samples s*R + j, so the batch
depends on (manifest, split, order, seed, seq_len, R, step) only, never on the process count.
Process p of P reads microbatch m, local row r = global row m*global_batch_size + p*(gbs/P) + r.

Batch dict (numpy, shape [accum, global_batch_size // P, seq_len]):
    inputs int32, targets int32, loss_mask float32 (1 = counted), segment_ids int32 (1, 2, … per
    document within a row), positions int32 (0 at the row start and at every document start).
For sequential/shuffle, segment_ids are 1, positions 0..T-1 and loss_mask 1 everywhere. For
document_buffer, the target of each document's last token (the join into the next document) has
loss_mask 0.

Rollouts (a manifest with layout "rollouts", see rollouts.py): record i is rollout i, one per row
and never cut (seq_len must hold its longest rollout); orders sequential and shuffle permute
rollouts as above, document_buffer is refused. A rollout of L tokens fills row positions
0..L-2 (inputs its tokens 0..L-2, targets 1..L-1, segment 1); the rest is padding (inputs and
targets 0, segment 0, loss_mask 0). loss_mask is the rollout's (1 on completion targets) and
`fields` adds the requested per-token float32 arrays ("advantages", "old_logprobs") of the
targets, 0 on padding.

State. Grain iterates a MapDataset whose index is the step, so Grain's own iterator state
{"next_index": step} is exact; get_state() wraps it with the identity of the order (fingerprint,
split, order, seed, seq_len, global batch, accum). Process count is not part of it: a state saved
with P processes restores under any other P and yields the same global batches.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import grain
import numpy as np

from jobspec.errors import ConfigError, DataError
from jobspec.run_config import DataConfig, TrainingConfig
from jobspec.storage import is_remote, url_to_fs
from runtime.data.manifest import PG_FIELDS, Manifest, read_offsets
from runtime.data.tokenizer import tokenizer_id_for

Order = Literal["sequential", "shuffle", "document_buffer"]
ORDERS = ("sequential", "shuffle", "document_buffer")
STATE_KIND = "jaxjob.token_batches/1"
# Per-token fields (besides tokens and loss_mask) each objective reads from a rollouts manifest.
OBJECTIVE_FIELDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "clipped_pg": PG_FIELDS,
}
_EPOCH_CACHE = 4  # a step may straddle an epoch end; prefetch threads may be a step or two apart


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
            return np.frombuffer(
                fs.cat_file(path, start=lo * size, end=hi * size), dtype=self.dtype
            )
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


class StepBatch(NamedTuple):
    step: int
    batch: dict[str, np.ndarray]
    provenance: dict[str, Any]


class _EpochCache:
    """Per-epoch permutations, computed once and shared by the prefetch threads."""

    def __init__(self, build):
        self._build = build
        self._items: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, epoch: int) -> Any:
        with self._lock:
            if epoch in self._items:
                return self._items[epoch]
        value = self._build(epoch)  # outside the lock: deterministic, so a duplicate is harmless
        with self._lock:
            self._items[epoch] = value
            while len(self._items) > _EPOCH_CACHE:
                del self._items[min(self._items)]
        return value


def _permutation(seed: int, epoch: int, stream: int, n: int) -> np.ndarray:
    # `stream` separates record and document permutations drawn from the same (seed, epoch).
    return np.random.default_rng([seed, epoch, stream]).permutation(n)


class TokenBatches:
    """The global batch order of one split, and this process's rows of it."""

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        seq_len: int,
        global_batch_size: int,
        accum: int = 1,
        order: Order = "shuffle",
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 2,
        fields: tuple[str, ...] = (),
    ):
        if order not in ORDERS:
            raise ConfigError(f"data.order is {order!r}; use one of {', '.join(ORDERS)}")
        check_order(manifest, order)
        if missing := [f for f in fields if f not in manifest.field_names]:
            raise DataError(
                f"the batches need the per-token fields {missing} but {manifest.root} "
                f"({manifest.layout} layout) carries {list(manifest.field_names)}; prepare "
                "rollouts that have them (`runtime data prepare --format rollouts`)"
            )
        if seq_len <= 0 or global_batch_size <= 0 or accum <= 0:
            raise ConfigError(
                "training.seq_len, training.global_batch_size and "
                "training.gradient_accumulation_steps must all be positive"
            )
        if not 0 <= process_index < process_count:
            raise ConfigError(
                f"process index {process_index} is outside 0..{process_count - 1}; check "
                "JAXJOB_PROCESS_ID and JAXJOB_NUM_PROCESSES"
            )
        if global_batch_size % process_count:
            raise ConfigError(
                f"training.global_batch_size ({global_batch_size}) is not divisible by the "
                f"{process_count} processes; make it a multiple of {process_count}"
            )
        self.manifest, self.split, self.order, self.seed = manifest, split, order, seed
        self.seq_len, self.global_batch_size, self.accum = seq_len, global_batch_size, accum
        self.process_index, self.process_count = process_index, process_count
        self.prefetch = prefetch
        self.stream = TokenStream(manifest, split)
        self._iterators: weakref.WeakSet[BatchIterator] = weakref.WeakSet()
        self.rollouts = manifest.layout == "rollouts"
        self.fields = tuple(fields)
        if self.rollouts:
            self._init_rollouts(split)
        else:
            self.records_per_epoch = (self.stream.length - 1) // seq_len
        if self.records_per_epoch < 1 and self.rollouts:
            raise DataError(
                f"the {split} split of {manifest.root} holds no rollouts; prepare more rollouts"
                + (" or set data.prepare.val_fraction > 0" if split == "validation" else "")
            )
        if self.records_per_epoch < 1:
            hint = " (data.prepare.val_fraction > 0 fills it)" if split == "validation" else ""
            raise DataError(
                f"the {split} split of {manifest.root} has {self.stream.length} tokens but one row "
                f"needs seq_len+1 = {seq_len + 1}; lower training.seq_len or prepare more data{hint}"
            )
        self.rows_per_step = global_batch_size * accum
        self.local_rows = global_batch_size // process_count
        # Global row j of every step that this process owns, laid out [accum, local_rows].
        m = np.arange(accum)[:, None] * global_batch_size
        self._local_j = m + process_index * self.local_rows + np.arange(self.local_rows)[None, :]
        self._records = _EpochCache(lambda e: _permutation(seed, e, 0, self.records_per_epoch))
        if order == "document_buffer":
            offsets = read_offsets(manifest, split)
            self._doc_starts, self._doc_lens = offsets[:-1], np.diff(offsets)
            self._docs = _EpochCache(self._doc_epoch)
        self._plain_layout = {
            "loss_mask": np.ones(seq_len, np.float32),
            "segment_ids": np.ones(seq_len, np.int32),
            "positions": np.arange(seq_len, dtype=np.int32),
        }

    def _init_rollouts(self, split: str) -> None:
        """One record per rollout: its token range, and the aligned field streams."""
        offsets = read_offsets(self.manifest, split)
        self._doc_starts, self._doc_lens = offsets[:-1], np.diff(offsets)
        self.records_per_epoch = len(self._doc_lens)
        check_rollouts_fit(self.manifest, split, self.seq_len, int(self._doc_lens.max(initial=0)))
        self._field_streams = {
            f: TokenStream(self.manifest, split, f) for f in ("loss_mask", *self.fields)
        }

    # --- order: which record is global sample n -------------------------------------------------

    def record_ids(self, step: int) -> np.ndarray:
        """The R global record ids of `step`, computed without reading tokens."""
        n = step * self.rows_per_step + np.arange(self.rows_per_step, dtype=np.int64)
        epoch, i = np.divmod(n, self.records_per_epoch)
        if self.order == "sequential":
            return i
        if self.order == "document_buffer":
            return n  # = epoch * N + i
        out = np.empty_like(i)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._records.get(int(e))[i[sel]]
        return out

    def local_record_ids(self, step: int) -> np.ndarray:
        """[accum, local_rows] record ids of the rows this process reads at `step`."""
        return self.record_ids(step)[self._local_j]

    def provenance(self, step: int, ids: np.ndarray | None = None) -> dict[str, Any]:
        ids = self.record_ids(step) if ids is None else ids
        seed = 0 if self.order == "sequential" else self.seed  # sequential ignores the seed
        head = f"{self.manifest.fingerprint}|{self.split}|{self.order}|{seed}|{self.seq_len}|"
        digest = hashlib.sha256(head.encode() + ids.astype("<i8").tobytes()).hexdigest()[:16]
        return {"step": step, "record_ids": ids.tolist(), "batch_hash": digest}

    # --- reading rows ----------------------------------------------------------------------------

    def _doc_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        perm = _permutation(self.seed, epoch, 1, len(self._doc_lens))
        ends = np.cumsum(self._doc_lens[perm], dtype=np.int64)
        return perm, np.concatenate([[0], ends])

    def _read_doc_row(self, rid: int, out: dict[str, np.ndarray], idx: tuple[int, int]) -> None:
        T = self.seq_len
        epoch, row = divmod(rid, self.records_per_epoch)
        perm, cum = self._docs.get(epoch)
        pos, stop = row * T, row * T + T + 1
        j = int(np.searchsorted(cum, pos, side="right")) - 1
        tokens, seg, posn = out["tokens"][idx], out["segment_ids"][idx], out["positions"][idx]
        mask = out["loss_mask"][idx]
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

    def _read_rollout_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """One rollout per row, left-aligned; the rest of the row is padding (segment 0, masked).

        A rollout of L tokens fills positions 0..L-2: inputs are its tokens 0..L-2 and targets,
        loss mask and fields are those of its tokens 1..L-1 (a field belongs to its target)."""
        shape = rows.shape + (self.seq_len,)
        out = {
            "inputs": np.zeros(shape, np.int32),
            "targets": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.float32),
            "segment_ids": np.zeros(shape, np.int32),
            "positions": np.zeros(shape, np.int32),
            **{f: np.zeros(shape, np.float32) for f in self.fields},
        }
        for idx in np.ndindex(rows.shape):
            d = int(rows[idx])
            lo, n = int(self._doc_starts[d]), int(self._doc_lens[d]) - 1
            tokens = self.stream.read(lo, lo + n + 1)
            out["inputs"][idx][:n] = tokens[:-1]
            out["targets"][idx][:n] = tokens[1:]
            out["segment_ids"][idx][:n] = 1
            out["positions"][idx][:n] = np.arange(n)
            for f, stream in self._field_streams.items():
                out[f][idx][:n] = stream.read(lo + 1, lo + n + 1)
        return out

    def read_step(self, step: int, ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """This process's [accum, local_rows, seq_len] arrays for `step` (what Grain maps)."""
        T = self.seq_len
        rows = (self.record_ids(step) if ids is None else ids)[self._local_j]
        if self.rollouts:
            return self._read_rollout_rows(rows)
        shape = rows.shape
        tokens = np.empty(shape + (T + 1,), np.int32)
        if self.order == "document_buffer":
            out = {
                "tokens": tokens,
                "loss_mask": np.ones(shape + (T,), np.float32),
                "segment_ids": np.empty(shape + (T,), np.int32),
                "positions": np.empty(shape + (T,), np.int32),
            }
            for idx in np.ndindex(shape):
                self._read_doc_row(int(rows[idx]), out, idx)
            layout = {k: out[k] for k in ("loss_mask", "segment_ids", "positions")}
        else:
            tokens[...] = self.stream.read_windows(rows.ravel() * T, T + 1).reshape(tokens.shape)
            layout = {
                k: np.broadcast_to(v, shape + (T,)).copy() for k, v in self._plain_layout.items()
            }
        return {
            "inputs": np.ascontiguousarray(tokens[..., :-1]),
            "targets": np.ascontiguousarray(tokens[..., 1:]),
            **layout,
        }

    def _element(self, step: int) -> dict[str, Any]:
        ids = self.record_ids(step)
        return {
            "step": step,
            "batch": self.read_step(step, ids),
            "provenance": self.provenance(step, ids),
        }

    # --- Grain iteration and state ---------------------------------------------------------------

    def dataset(self, stop_step: int | None = None) -> grain.MapDataset:
        """Step-indexed Grain dataset: element s is step s's local batch and provenance."""
        return grain.MapDataset.range(sys.maxsize if stop_step is None else stop_step).map(
            self._element
        )

    def identity(self) -> dict[str, Any]:
        return {
            "fingerprint": self.manifest.fingerprint,
            "split": self.split,
            "order": self.order,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "accum": self.accum,
        }

    def state_for(self, step: int) -> dict[str, Any]:
        """The iterator state just before `step` is yielded (JSON-serialisable)."""
        return {
            "kind": STATE_KIND,
            "next_step": step,
            "grain": {"next_index": step},
            **self.identity(),
        }

    def iterate(self, start_step: int = 0, stop_step: int | None = None) -> BatchIterator:
        it = BatchIterator(self, start_step, stop_step)
        self._iterators.add(it)
        return it

    def close(self) -> None:
        """Close every iterator this loader made (stops their prefetch threads)."""
        for it in list(self._iterators):
            it.close()

    def describe(self) -> dict[str, Any]:
        """What diagnostics/runtime.json records about the loader."""
        return {
            "engine": f"grain {getattr(grain, '__version__', '')}".strip(),
            **self.identity(),
            "records_per_epoch": self.records_per_epoch,
            "rows_per_step": self.rows_per_step,
            "local_rows": self.local_rows,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "prefetch": self.prefetch,
            "remote": self.stream.remote,
            "layout": self.manifest.layout,
            "fields": ["loss_mask", *self.fields] if self.rollouts else [],
        }


class BatchIterator:
    """Yields StepBatch(step, batch, provenance) from Grain with `prefetch` threads ahead."""

    def __init__(self, batches: TokenBatches, start_step: int = 0, stop_step: int | None = None):
        self._batches = batches
        n = max(0, batches.prefetch)
        opts = grain.ReadOptions(num_threads=n, prefetch_buffer_size=n)
        self._it = iter(batches.dataset(stop_step).to_iter_dataset(opts))
        if start_step:
            self._it.set_state({"next_index": int(start_step)})

    def __iter__(self) -> Iterator[StepBatch]:
        return self

    def __next__(self) -> StepBatch:
        el = self._it.__next__()
        return StepBatch(el["step"], el["batch"], el["provenance"])

    def get_state(self) -> dict[str, Any]:
        grain_state = self._it.get_state()
        return {
            **self._batches.state_for(int(grain_state["next_index"])),
            "grain": dict(grain_state),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != STATE_KIND:
            raise DataError(
                f"the saved data-iterator state has kind {state.get('kind')!r}, not {STATE_KIND!r}; "
                "it was written by another loader version, start the run fresh"
            )
        for key, want in self._batches.identity().items():
            if state.get(key) != want:
                raise DataError(
                    f"the saved data-iterator state has {key} {state.get(key)!r} but this run has "
                    f"{want!r}; resume with the settings the checkpoint was made with"
                )
        self._it.set_state(dict(state["grain"]))

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def train_batches(
    manifest: Manifest,
    data: DataConfig,
    training: TrainingConfig,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> TokenBatches:
    """The training loader for a run config's data/training sections (run.seed as the seed)."""
    return TokenBatches(
        manifest,
        "train",
        training.seq_len,
        training.global_batch_size,
        accum=training.gradient_accumulation_steps,
        order=data.order,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        prefetch=data.prefetch,
        fields=OBJECTIVE_FIELDS[training.objective],
    )


def eval_loader(
    manifest: Manifest,
    split: str,
    seq_len: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 2,
) -> TokenBatches:
    """The fixed eval order of a split: sequential global batches, accum 1. Build it once and
    call `.iterate(0, num_batches)` for every eval."""
    return TokenBatches(
        manifest,
        split,
        seq_len,
        global_batch_size,
        accum=1,
        order="sequential",
        process_index=process_index,
        process_count=process_count,
        prefetch=prefetch,
    )


def eval_batches(
    manifest: Manifest,
    split: str,
    seq_len: int,
    global_batch_size: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 2,
) -> BatchIterator:
    """A fresh, fixed sequence of `num_batches` sequential global batches (accum = 1).

    Every call yields the same batches: the first num_batches × global_batch_size records of the
    split, wrapping around if the split is shorter.
    """
    loader = eval_loader(
        manifest, split, seq_len, global_batch_size, process_index, process_count, prefetch
    )
    return loader.iterate(0, num_batches)


def check_for_run(
    manifest: Manifest, data: DataConfig, vocab_size: int, training: TrainingConfig | None = None
) -> None:
    """The start-of-run checks: data.tokenizer matches the manifest, ids fit model.vocab_size,
    and (given the training section) the order, objective and seq_len fit the manifest's layout."""
    check_tokenizer(manifest, data.tokenizer)
    check_vocab(manifest, vocab_size)
    check_order(manifest, data.order)
    if training is not None:
        check_objective(manifest, training.objective)
        if manifest.layout == "rollouts":
            for split in ("train", "validation"):  # evals read either split: check both up front
                longest = manifest.split(split).max_document_tokens or 0
                check_rollouts_fit(manifest, split, training.seq_len, longest)


def check_rollouts_fit(manifest: Manifest, split: str, seq_len: int, longest: int) -> None:
    """A row holds one whole rollout: L tokens make L - 1 predictions."""
    if longest - 1 > seq_len:
        raise DataError(
            f"the longest rollout in the {split} split of {manifest.root} has {longest} tokens, "
            f"so it needs {longest - 1} predictions but a row holds training.seq_len = {seq_len}; "
            f"raise training.seq_len to at least {longest - 1} (rollouts are never cut)"
        )


def check_order(manifest: Manifest, order: str) -> None:
    """A rollouts manifest holds one rollout per row: packing would cut rollouts apart."""
    if manifest.layout == "rollouts" and order == "document_buffer":
        raise ConfigError(
            "data.order = 'document_buffer' packs documents across rows, which would cut rollouts "
            f"apart; {manifest.root} is a rollouts manifest (one rollout per row), so set data.order "
            "to 'shuffle' or 'sequential'"
        )


def check_objective(manifest: Manifest, objective: str) -> None:
    """The manifest must carry every per-token field the objective consumes."""
    missing = [f for f in OBJECTIVE_FIELDS[objective] if f not in manifest.field_names]
    if not missing:
        return
    where = f"{manifest.root}/manifest.json"
    if manifest.layout == "stream":
        what = (
            f"{where} is a text token stream; prepare rollout JSONL with `runtime data prepare "
            '--format rollouts` (README, "RL rollouts")'
        )
    else:
        what = (
            f"{where} holds supervised rollouts (no advantages or old log-probs); prepare it from "
            'rollout lines that carry "advantage" (or "advantages") and "old_logprobs"'
        )
    raise DataError(
        f"training.objective = {objective!r} needs per-token {' and '.join(missing)} but {what}, "
        "or set training.objective = 'cross_entropy'"
    )


def check_vocab(manifest: Manifest, vocab_size: int) -> None:
    """Fail before training if a token id would index past the embedding table."""
    if manifest.max_token_id >= vocab_size:
        x = manifest.max_token_id
        raise DataError(
            f"the data has token ids up to {x} but model.vocab_size is {vocab_size}; raise "
            f"model.vocab_size to at least {x + 1}"
        )


def check_tokenizer(manifest: Manifest, spec: str | None) -> None:
    """Fail if data.tokenizer names another tokenizer than the one the manifest was made with."""
    if spec is None:
        return
    want = tokenizer_id_for(spec)
    if want != manifest.tokenizer.id:
        also = "" if want == spec else f" (id {want})"
        raise DataError(
            f"data.tokenizer is {spec!r}{also} but the manifest was made with "
            f"{manifest.tokenizer.id!r}; set data.tokenizer to the manifest's tokenizer or "
            "re-run `runtime data prepare` with this one"
        )
