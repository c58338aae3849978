"""Evals from `[[evals]]`: a fixed, deterministic set of batches, losses as sums and counts.

Over a `[[data.sources]]` mixture a row also holds each source's figures, keyed by its name:
`loss_per_source` (None for a source with no counted token), `loss_sum_per_source` and
`token_count_per_source`. They are summed in the eval step over the global batch, as the totals
are, so they cover every host's rows, and the sources' sums add up to the totals.
"""

from __future__ import annotations

import jax

from jobspec.run_config import RunConfig
from runfolder.layout import EvalRow, EventKind, now
from runtime.data.loader import TokenBatches, eval_loader
from runtime.data.mixture import Mixture
from runtime.model.sharding import batch_sharding, host_rows, on_mesh, replicated
from runtime.run.artifacts import RunArtifacts
from runtime.train.metrics import eval_line
from runtime.train.step import make_eval_step


class Evaluator:
    def __init__(self, cfg: RunConfig, manifest, parts, mesh):
        self.cfg, self.manifest, self.mesh = cfg, manifest, mesh
        self.others = parts.others
        self.b_sh = batch_sharding(mesh, 3, leading=1)
        t = cfg.training
        self.rows = host_rows(self.b_sh, (1, t.global_batch_size, t.seq_len))
        rep = replicated(mesh)
        self.sources = list(manifest.names) if isinstance(manifest, Mixture) else []
        t = cfg.training
        step = make_eval_step(parts.graphdef, t.loss_chunk_size, len(self.sources), t.logits_dtype)
        self.step_fn = jax.jit(
            # Under the mesh like the train step: the same constraints and attention kernels.
            on_mesh(step, mesh),
            in_shardings=(parts.param_shardings, rep, self.b_sh),
            out_shardings=rep,
        )
        self._loaders: dict[str, TokenBatches] = {}  # one per split: offsets are read once
        self._last: tuple[int, dict[str, float]] | None = None  # the last step evaluated

    def _loader(self, split: str) -> TokenBatches:
        if split not in self._loaders:
            t = self.cfg.training
            self._loaders[split] = eval_loader(
                self.manifest,
                split,
                t.seq_len,
                t.global_batch_size,
                process_index=self.rows[0],
                process_count=self.rows[1],
                prefetch=self.cfg.data.prefetch,
            )
        return self._loaders[split]

    def evaluate(
        self, params, name: str, split: str, num_batches: int, others: tuple | None = None
    ) -> dict:
        """Loss over the split's first num_batches global batches. `others` is the model's
        current non-Param state (MoE router biases move in training); default the built one."""
        t = self.cfg.training
        shape = (1, t.global_batch_size, t.seq_len)
        others = self.others if others is None else others
        sums = []
        with self._loader(split).iterate(0, num_batches) as batches:
            for item in batches:
                batch = {
                    k: jax.make_array_from_process_local_data(
                        self.b_sh, v[..., self.rows[2]], shape
                    )
                    for k, v in item.batch.items()
                }
                sums.append(self.step_fn(params, others, batch))
        got = jax.device_get(sums)
        loss_sum = float(sum(s["loss_sum"] for s in got))
        count = float(sum(s["token_count"] for s in got))
        out = {
            "name": name,
            "split": split,
            "loss": loss_sum / max(count, 1.0),
            "loss_sum": loss_sum,
            "token_count": count,
            "batches": len(got),
        }
        if self.sources:
            out.update(per_source(self.sources, got))
        return out

    def due(self, step: int) -> bool:
        """Whether `step` is a periodic eval (`training.eval_every`; the final one is the
        caller's)."""
        t = self.cfg.training
        return t.eval_every > 0 and step % t.eval_every == 0 and step < t.total_steps

    def at(self, step: int, state, run_art: RunArtifacts, emit) -> dict[str, float]:
        """Every configured eval at `step`, once: a step already evaluated (a --max-steps stop
        on a periodic eval) gives the losses it had."""
        if self._last is None or self._last[0] != step:
            self._last = (step, self.run(state.params, step, run_art, emit, state.model_state))
        return self._last[1]

    def run(
        self, params, step: int, run_art: RunArtifacts, emit, others: tuple | None = None
    ) -> dict[str, float]:
        """Every configured eval at `step`; rows to metrics/eval.jsonl; {name: loss}."""
        losses = {}
        for e in self.cfg.evals:
            result = self.evaluate(params, e.name, e.split, e.batches, others)
            row = EvalRow(step=step, time=now(), **result)
            run_art.eval_row(row)
            run_art.event(EventKind.EVAL, step=step, name=e.name, loss=row.loss)
            emit(eval_line(step, e.name, row.loss, row.token_count, row.loss_per_source))
            losses[e.name] = row.loss
        return losses


def per_source(names: list[str], got: list[dict]) -> dict[str, dict[str, float | None]]:
    """The per-source fields of a row from the eval step's sums over its batches."""
    sums = [float(sum(s["loss_sum_per_source"][j] for s in got)) for j in range(len(names))]
    counts = [float(sum(s["token_count_per_source"][j] for s in got)) for j in range(len(names))]
    return {
        "loss_per_source": {
            n: (ls / c if c > 0 else None) for n, ls, c in zip(names, sums, counts, strict=True)
        },
        "loss_sum_per_source": dict(zip(names, sums, strict=True)),
        "token_count_per_source": dict(zip(names, counts, strict=True)),
    }
