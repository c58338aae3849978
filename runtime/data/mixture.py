"""Weighted mixtures of prepared manifests (`[[data.sources]]`): loading, checks, and the order.

Public API:
    Mixture(names, manifests, weights)         the loaded sources (one tokenizer, stream layout)
    load_data(data: DataConfig, is_writer=True) -> Manifest | Mixture   what a run trains on: one
                                               manifest (prepared on first use) or a mixture
    ensure_manifest(data: DataConfig, is_writer=True) -> Manifest   data.manifest, made first by
                                               `[data.prepare]` when absent
    open_data(data: DataConfig) -> Manifest | Mixture   the same without preparing (eval, import)
    manifests_of(data) -> list[Manifest]       the manifest(s) behind either
    block_counts(shares, block) -> np.ndarray  samples of each source in every block
    mixture_reader(mixture, split, seq_len, order, seed, fields) -> (MixtureSource, MixtureOrder)
    decode(ids, J) -> (source index, source record id)   of the loader's mixture record ids

The order. Global sample n (as for one manifest) lies in block b = n // M at position
i = n % M (M = MIXTURE_BLOCK). Every block holds exactly c_j samples of source j, the
largest-remainder rounding of share_j × M, laid out as the labels [0]*c_0 + [1]*c_1 + …
permuted from (seed, b). Sample n is source j = label_b[i], and the k_j-th sample drawn from
source j, k_j = b × c_j + (the count of label j before i in block b): O(M) from (seed, n) alone,
whatever the step. Source j's own order (data.order over its records, seeded from (seed, j))
maps k_j to its record id r, and the loader's record id of the sample is r × J + j.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import numpy as np

from jobspec.errors import DataError
from jobspec.run_config import MIXTURE_BLOCK, DataConfig, DataOrder
from runfolder.storage import url_to_fs
from runtime.data.manifest import Manifest, load_manifest
from runtime.data.order import EpochCache, RecordOrder, permutation, record_order
from runtime.data.sources import RecordSource, Rows, record_source

MIXTURE_STREAM = 2  # the block permutations: apart from order.py's record and document streams


class SplitTotals(NamedTuple):
    tokens: int
    documents: int


class Mixture:
    """Several stream manifests of one tokenizer, drawn by weight. It answers what a run asks of
    its data (fingerprint, tokenizer, layout, split sizes) for all of them together."""

    layout = "stream"

    def __init__(self, names: list[str], manifests: list[Manifest], weights: list[float]):
        first = manifests[0].tokenizer.id
        for j, m in enumerate(manifests):
            if m.layout != "stream":
                raise DataError(
                    f"data.sources[{j}] ({names[j]}) is a {m.layout} manifest but a mixture draws "
                    "rows from text token streams only; train on rollouts with data.manifest alone"
                )
            if m.tokenizer.id != first:
                raise DataError(
                    f"data.sources[{j}] ({names[j]}) was prepared with tokenizer "
                    f"{m.tokenizer.id!r} but data.sources[0] ({names[0]}) with {first!r}; every "
                    "source of a mixture needs the same tokenizer, so prepare one of them again "
                    "with the other's (`runtime data prepare --tokenizer …`)"
                )
        self.names, self.manifests, self.weights = list(names), list(manifests), list(weights)
        total = sum(weights)
        self.shares = [w / total for w in weights]
        self.counts = block_counts(self.shares, MIXTURE_BLOCK)
        self.tokenizer = manifests[0].tokenizer
        # What fixes the mixture's samples: each source's name, content and weight, in order.
        parts = [[n, m.fingerprint, w] for n, m, w in zip(names, manifests, weights, strict=True)]
        self.fingerprint = "mix:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def split(self, name: str) -> SplitTotals:
        """The sources' sizes of a split, summed."""
        splits = [m.split(name) for m in self.manifests]
        return SplitTotals(sum(s.tokens for s in splits), sum(s.documents for s in splits))

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "manifest": m.root, "fingerprint": m.fingerprint, "weight": w,
             "share": s, "per_block": int(c)}
            for n, m, w, s, c in zip(
                self.names, self.manifests, self.weights, self.shares, self.counts, strict=True
            )
        ]  # fmt: skip


def block_counts(shares: list[float], block: int) -> np.ndarray:
    """Samples of each source per block: floor(share × block), plus one for the sources with the
    largest remainders (ties to the earlier source) until the block is full."""
    exact = np.asarray(shares, dtype=np.float64) * block
    counts = np.floor(exact).astype(np.int64)
    short = block - int(counts.sum())
    by_remainder = sorted(range(len(shares)), key=lambda j: (-(exact[j] - counts[j]), j))
    for j in by_remainder[:short]:
        counts[j] += 1
    return counts


def source_seed(seed: int, j: int) -> int:
    """Source j's own order seed, drawn from (seed, j)."""
    return int(np.random.SeedSequence([seed, MIXTURE_STREAM, j]).generate_state(1)[0])


def decode(ids: np.ndarray, num_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """(source index, the source's record id) of mixture record ids r × J + j."""
    rid, src = np.divmod(ids, num_sources)
    return src, rid


class MixtureOrder:
    """Global sample n → source j and that source's record id, as r × J + j (module docstring)."""

    def __init__(self, counts: np.ndarray, orders: list[RecordOrder], seed: int):
        self.counts, self.orders, self.seed = counts, orders, seed
        self.block = int(counts.sum())
        self._blocks = EpochCache(self._layout)

    def _layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's source of each position, and how many of that source came before it."""
        labels = np.repeat(np.arange(len(self.counts)), self.counts)
        labels = labels[permutation(self.seed, b, MIXTURE_STREAM, self.block)]
        by_source = np.argsort(labels, kind="stable")  # positions of source 0, then 1, …
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        rank = np.empty(self.block, np.int64)
        rank[by_source] = np.arange(self.block) - starts[labels[by_source]]
        return labels, rank

    def sources_and_counts(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(j, k_j) of global samples n: the source, and the samples drawn from it before n."""
        b, i = np.divmod(np.asarray(n, dtype=np.int64), self.block)
        j, k = np.empty_like(i), np.empty_like(i)
        for blk in np.unique(b):
            sel = b == blk
            labels, rank = self._blocks.get(int(blk))
            j[sel] = labels[i[sel]]
            k[sel] = int(blk) * self.counts[j[sel]] + rank[i[sel]]
        return j, k

    def ids(self, n: np.ndarray) -> np.ndarray:
        j, k = self.sources_and_counts(n)
        out = np.empty_like(k)
        for src in np.unique(j):
            sel = j == src
            out[sel] = self.orders[int(src)].ids(k[sel]) * len(self.orders) + src
        return out


class MixtureSource:
    """The rows of mixture record ids: each read from its own source."""

    def __init__(self, sources: list[RecordSource]):
        self.sources = sources
        self.records_per_epoch = sum(s.records_per_epoch for s in sources)  # one pass over each
        self.remote = any(s.remote for s in sources)
        self.field_names: list[str] = []

    def read(self, ids: np.ndarray) -> Rows:
        src, rid = decode(ids, len(self.sources))
        out: Rows = {}
        for j in np.unique(src):
            sel = src == j
            rows = self.sources[int(j)].read(rid[sel])
            for key, arr in rows.items():
                if key not in out:
                    out[key] = np.empty(ids.shape + arr.shape[1:], arr.dtype)
                out[key][sel] = arr
        return out


def mixture_reader(
    mixture: Mixture,
    split: str,
    seq_len: int,
    order: DataOrder,
    seed: int,
    fields: tuple[str, ...],
) -> tuple[MixtureSource, MixtureOrder]:
    """The record source and order of a mixture's split (each source ordered by data.order)."""
    seeds = [source_seed(seed, j) for j in range(len(mixture.manifests))]
    sources = [
        record_source(m, split, seq_len, order, s, fields)
        for m, s in zip(mixture.manifests, seeds, strict=True)
    ]
    orders = [
        record_order(order, src.records_per_epoch, s) for src, s in zip(sources, seeds, strict=True)
    ]
    return MixtureSource(sources), MixtureOrder(mixture.counts, orders, seed)


def manifests_of(data: Manifest | Mixture) -> list[Manifest]:
    return data.manifests if isinstance(data, Mixture) else [data]


def _load_source(i: int, uri: str) -> Manifest:
    try:
        return load_manifest(uri)
    except DataError as e:  # its sentence names data.manifest: name the source's key instead
        raise DataError(str(e).replace("data.manifest", f"data.sources[{i}].manifest")) from None


def open_data(data: DataConfig) -> Manifest | Mixture:
    """The manifest or mixture `data` names, as it is now (nothing is prepared)."""
    if data.sources is None:
        return load_manifest(data.manifest or "")
    manifests = [_load_source(i, s.manifest) for i, s in enumerate(data.sources)]
    return Mixture([d.name for d in data.datasets], manifests, [s.weight for s in data.sources])


def ensure_manifest(data: DataConfig, *, is_writer: bool = True) -> Manifest:
    """Load the manifest; make it first when it is absent and `[data.prepare]` says how.

    Only the writer prepares (the prepare side, runtime/data/prepare/, is imported only then);
    the other hosts wait for it at a barrier, so a multi-host job prepares once (on storage
    every host reads: a shared path or gs://).
    """
    if data.prepare is not None:
        fs, path = url_to_fs(data.manifest)
        if is_writer and not fs.exists(path):
            from runtime.data.prepare.build import prepare_for_run

            prepare_for_run(data)
        import jax  # here only: loading a manifest never needs it
        from jax.experimental import multihost_utils

        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxjob:data-prepared")
    return load_manifest(data.manifest)


def load_data(data: DataConfig, *, is_writer: bool = True) -> Manifest | Mixture:
    """What a run trains on: the manifest (prepared first where `[data.prepare]` says so; only
    the writer prepares) or the mixture of `[[data.sources]]`."""
    if data.sources is None:
        return ensure_manifest(data, is_writer=is_writer)
    return open_data(data)
