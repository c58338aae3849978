"""Evals from `[[evals]]`: a fixed, deterministic set of batches, losses as sums and counts."""

from __future__ import annotations

import jax

from jobspec.run_config import RunConfig
from runtime.artifacts import now
from runtime.data.pipeline import eval_batches
from runtime.metrics import eval_line
from runtime.sharding import batch_sharding, replicated
from runtime.train_step import make_eval_step


class Evaluator:
    def __init__(self, cfg: RunConfig, manifest, parts, mesh):
        self.cfg, self.manifest, self.mesh = cfg, manifest, mesh
        self.b_sh = batch_sharding(mesh, 3, leading=1)
        self.step_fn = jax.jit(
            make_eval_step(parts.graphdef, parts.others),
            in_shardings=(parts.param_shardings, self.b_sh),
            out_shardings=replicated(mesh),
        )

    def evaluate(self, params, name: str, split: str, num_batches: int) -> dict:
        t = self.cfg.training
        shape = (1, t.global_batch_size, t.seq_len)
        sums = []
        with eval_batches(
            self.manifest,
            split,
            t.seq_len,
            t.global_batch_size,
            num_batches,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            prefetch=self.cfg.data.prefetch,
        ) as batches:
            for item in batches:
                batch = {
                    k: jax.make_array_from_process_local_data(self.b_sh, v, shape)
                    for k, v in item.batch.items()
                }
                sums.append(self.step_fn(params, batch))
        got = jax.device_get(sums)
        loss_sum = float(sum(s["loss_sum"] for s in got))
        count = float(sum(s["token_count"] for s in got))
        return {
            "name": name,
            "split": split,
            "loss": loss_sum / max(count, 1.0),
            "loss_sum": loss_sum,
            "token_count": count,
            "batches": len(got),
        }

    def run(self, params, step: int, run_art, emit) -> dict[str, float]:
        """Every configured eval at `step`; rows to metrics/eval.jsonl; {name: loss}."""
        losses = {}
        for e in self.cfg.evals:
            row = {"step": step, "time": now(), **self.evaluate(params, e.name, e.split, e.batches)}
            run_art.eval_row(row)
            run_art.event("eval", step=step, name=e.name, loss=row["loss"])
            emit(eval_line(step, e.name, row["loss"], row["token_count"]))
            losses[e.name] = row["loss"]
        return losses
