"""The Grain-driven training data loader: one global batch order, each process reading its own rows.

Public API:
    TokenBatches(manifest, split, seq_len, global_batch_size, accum=1, order="shuffle", seed=0,
                 process_index=0, process_count=1, prefetch=2, fields=(), row_sources=False)
                                      manifest: a Manifest, or a Mixture (mixture.py); with
                                      row_sources a mixture's batches add `source` (below)
        .iterate(start_step=0, stop_step=None) -> BatchIterator   Grain-backed, prefetching
        .read_step(step) -> dict[str, np.ndarray]                 this process's arrays, no Grain
        .record_ids(step) -> np.ndarray                           the step's R global record ids
        .provenance(step) -> dict                                 {"step", "record_ids", "batch_hash"}
                                             a mixture's adds "sources" and "tokens_per_source"
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

The loader picks a record source (sources.py: the rows of record ids) and a record order
(order.py: the record id of global sample n) once; a `[[data.sources]]` mixture has its own pair
(mixture.py: each sample's source, then that source's order and rows). Step s uses global rows
j = 0..R-1 (R = global_batch_size × accum) = samples s*R + j, so the batch depends on (manifest,
split, order, seed, seq_len, R, step) only, never on the process count. Process p of P reads
microbatch m, local row r = global row m*global_batch_size + p*(gbs/P) + r. The batch dict holds
the source's arrays shaped [accum, global_batch_size // P, seq_len]; an eval loader of a mixture
(row_sources) adds `source`, int32 of the same shape: each position's source index (the order of
the mixture's names), so an eval can report a loss per source.

State. Grain iterates a MapDataset whose index is the step, so Grain's own iterator state
{"next_index": step} is exact; get_state() wraps it with the identity of the order (fingerprint,
split, order, seed, seq_len, global batch, accum; a mixture's sources and weights). Process count
is not part of it: a state saved with P processes restores under any other P and yields the same
global batches.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import grain
import numpy as np

from jobspec.errors import ConfigError, DataError
from jobspec.run_config import DATA_ORDERS, DataConfig, DataOrder, TrainingConfig
from runtime.data.manifest import PG_FIELDS, Manifest, manifest_uri
from runtime.data.mixture import Mixture, decode, manifests_of, mixture_reader
from runtime.data.order import RecordOrder, record_order
from runtime.data.sources import RecordSource, check_rollouts_fit, record_source
from runtime.data.tokenizer import tokenizer_id_for

STATE_KIND = "jaxjob.token_batches/1"
# Per-token fields (besides tokens and loss_mask) each objective reads from a rollouts manifest.
OBJECTIVE_FIELDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "clipped_pg": PG_FIELDS,
}


class StepBatch(NamedTuple):
    step: int
    batch: dict[str, np.ndarray]
    provenance: dict[str, Any]


def _check_layout(data: Manifest | Mixture, order: str, fields: tuple[str, ...]) -> None:
    """The order is known and fits each manifest's layout, which carries the requested fields."""
    if order not in DATA_ORDERS:
        raise ConfigError(f"data.order is {order!r}; use one of {', '.join(DATA_ORDERS)}")
    for manifest in manifests_of(data):
        check_order(manifest, order)
        if missing := [f for f in fields if f not in manifest.field_names]:
            raise DataError(
                f"the batches need the per-token fields {missing} but {manifest.root} "
                f"({manifest.layout} layout) carries {list(manifest.field_names)}; prepare "
                "rollouts that have them (`runtime data prepare --format rollouts`)"
            )


def _check_sizes(sizes: tuple[int, int, int], process_index: int, process_count: int) -> None:
    """(seq_len, global_batch_size, accum) are positive and the batch splits over the processes."""
    if min(sizes) <= 0:
        raise ConfigError(
            "training.seq_len, training.global_batch_size and "
            "training.gradient_accumulation_steps must all be positive"
        )
    if not 0 <= process_index < process_count:
        raise ConfigError(
            f"process index {process_index} is outside 0..{process_count - 1}; check "
            "JAXJOB_PROCESS_ID and JAXJOB_NUM_PROCESSES"
        )
    if sizes[1] % process_count:
        raise ConfigError(
            f"training.global_batch_size ({sizes[1]}) is not divisible by the "
            f"{process_count} processes; make it a multiple of {process_count}"
        )


class TokenBatches:
    """The global batch order of one split, and this process's rows of it."""

    def __init__(
        self,
        manifest: Manifest | Mixture,
        split: str,
        seq_len: int,
        global_batch_size: int,
        accum: int = 1,
        order: DataOrder = "shuffle",
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 2,
        fields: tuple[str, ...] = (),
        row_sources: bool = False,
    ):
        sizes = (seq_len, global_batch_size, accum)
        _check_layout(manifest, order, fields)
        _check_sizes(sizes, process_index, process_count)
        self.manifest, self.split, self.order, self.seed = manifest, split, order, seed
        self.seq_len, self.global_batch_size, self.accum = seq_len, global_batch_size, accum
        self.process_index, self.process_count = process_index, process_count
        self.prefetch = prefetch
        self.fields = tuple(fields)
        self._iterators: weakref.WeakSet[BatchIterator] = weakref.WeakSet()
        self.mixture = manifest if isinstance(manifest, Mixture) else None
        self.row_sources = row_sources and self.mixture is not None
        self.source: RecordSource
        self.record_order: RecordOrder
        if isinstance(manifest, Mixture):
            self.source, self.record_order = mixture_reader(
                manifest, split, seq_len, order, seed, self.fields
            )
        else:
            self.source = record_source(manifest, split, seq_len, order, seed, self.fields)
            self.record_order = record_order(order, self.source.records_per_epoch, seed)
        self.records_per_epoch = self.source.records_per_epoch
        self.rows_per_step = global_batch_size * accum
        self.local_rows = global_batch_size // process_count
        # Global row j of every step that this process owns, laid out [accum, local_rows].
        m = np.arange(accum)[:, None] * global_batch_size
        self._local_j = m + process_index * self.local_rows + np.arange(self.local_rows)[None, :]

    def record_ids(self, step: int) -> np.ndarray:
        """The R global record ids of `step`, computed without reading tokens."""
        n = step * self.rows_per_step + np.arange(self.rows_per_step, dtype=np.int64)
        return self.record_order.ids(n)

    def local_record_ids(self, step: int) -> np.ndarray:
        """[accum, local_rows] record ids of the rows this process reads at `step`."""
        return self.record_ids(step)[self._local_j]

    def provenance(self, step: int, ids: np.ndarray | None = None) -> dict[str, Any]:
        ids = self.record_ids(step) if ids is None else ids
        if self.mixture is not None:
            return self._mixture_provenance(step, ids, self.mixture)
        seed = 0 if self.order == "sequential" else self.seed  # sequential ignores the seed
        head = f"{self.manifest.fingerprint}|{self.split}|{self.order}|{seed}|{self.seq_len}|"
        digest = hashlib.sha256(head.encode() + ids.astype("<i8").tobytes()).hexdigest()[:16]
        return {"step": step, "record_ids": ids.tolist(), "batch_hash": digest}

    def _mixture_provenance(self, step: int, ids: np.ndarray, mix: Mixture) -> dict[str, Any]:
        """Each row's source and its record id there; the hash covers both (the block order
        uses the seed even when every source is read sequentially)."""
        src, rid = decode(ids, len(mix.names))
        head = f"{mix.fingerprint}|{self.split}|{self.order}|{self.seed}|{self.seq_len}|"
        raw = rid.astype("<i8").tobytes() + src.astype("<i8").tobytes()
        rows = np.bincount(src, minlength=len(mix.names))
        return {
            "step": step,
            "record_ids": rid.tolist(),
            "sources": [mix.names[j] for j in src],
            "tokens_per_source": {
                n: int(r) * self.seq_len for n, r in zip(mix.names, rows, strict=True)
            },
            "batch_hash": hashlib.sha256(head.encode() + raw).hexdigest()[:16],
        }

    def read_step(self, step: int, ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """This process's [accum, local_rows, seq_len] arrays for `step` (what Grain maps)."""
        local = (self.record_ids(step) if ids is None else ids)[self._local_j]
        out = self.source.read(local)
        if self.row_sources:
            assert self.mixture is not None
            src, _ = decode(local, len(self.mixture.names))
            out["source"] = np.repeat(src[..., None].astype(np.int32), self.seq_len, axis=-1)
        return out

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
        out = {
            "fingerprint": self.manifest.fingerprint,
            "split": self.split,
            "order": self.order,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "accum": self.accum,
        }
        if self.mixture is not None:  # also in the fingerprint; listed so a state says itself
            m = self.mixture
            out["sources"] = [
                {"name": n, "fingerprint": f.fingerprint, "weight": w}
                for n, f, w in zip(m.names, m.manifests, m.weights, strict=True)
            ]
        return out

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
            "remote": self.source.remote,
            "layout": self.manifest.layout,
            "fields": list(self.source.field_names),
            **({"mixture": self.mixture.describe()} if self.mixture is not None else {}),
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
    manifest: Manifest | Mixture,
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
    manifest: Manifest | Mixture,
    split: str,
    seq_len: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 2,
) -> TokenBatches:
    """The fixed eval order of a split: sequential global batches, accum 1. Build it once and
    call `.iterate(0, num_batches)` for every eval. A mixture's eval reads every source's split,
    each sequentially, interleaved by weight in the blocks of seed 0: fixed across evals and runs;
    its batches carry `source`, each position's source index, for the loss per source."""
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
        row_sources=True,
    )


def eval_batches(
    manifest: Manifest | Mixture,
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
    data_in: Manifest | Mixture,
    data: DataConfig,
    vocab_size: int,
    training: TrainingConfig | None = None,
) -> None:
    """The start-of-run checks of every manifest (a mixture's sources each): data.tokenizer
    matches it, ids fit model.vocab_size, and (given the training section) the order, objective
    and seq_len fit its layout."""
    for manifest in manifests_of(data_in):
        check_tokenizer(manifest, data.tokenizer)
        check_vocab(manifest, vocab_size)
        check_order(manifest, data.order)
        if training is not None:
            check_objective(manifest, training.objective)
            if manifest.layout == "rollouts":
                for split in ("train", "validation"):  # evals read either split: check both now
                    longest = manifest.split(split).max_document_tokens or 0
                    check_rollouts_fit(manifest, split, training.seq_len, longest)


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
    where = manifest_uri(manifest.root)
    if manifest.layout == "stream":
        what = (
            f"{where} is a text token stream; prepare rollout JSONL with `runtime data prepare "
            '--format rollouts` (docs/data.md, "RL rollouts")'
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
