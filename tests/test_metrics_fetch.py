"""The loop's metric fetches: a `log_every` step's rows are read after the next step is
dispatched (the device is never left waiting for the host), with the same rows and lines."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jobspec.files.run_toml import parse_run_config
from runtime.train import metrics as metrics_module
from runtime.train.metrics import TrainMetrics

from runs import tiny_config


class _Artifacts:
    """What TrainMetrics hands the run's artifacts, kept in order with the loop's calls."""

    def __init__(self, log: list) -> None:
        self.log = log

    def train_rows(self, rows) -> None:
        self.log.append(("rows", [r.step for r in rows], [r.values for r in rows]))

    def event(self, kind, **fields) -> None:
        self.log.append(("event", kind))


def _outputs(step: int) -> dict:
    return {
        "loss": jnp.float32(10.0 / step),
        "grad_norm": jnp.float32(step + 0.25),
        "lr": jnp.float32(1e-3 * step),
    }


def _drive(monkeypatch, tmp_path, log_every: int, steps: int, sync_at: set[int]):
    """The loop's calls for `steps` steps: dispatch, then step_done; -> (log, lines)."""
    cfg = parse_run_config(
        tiny_config("unused/manifest.json", str(tmp_path), training={"log_every": log_every})
    )
    log: list = []
    real_get = jax.device_get

    def spy(tree):
        log.append(("fetch", len(tree)))
        return real_get(tree)

    monkeypatch.setattr(metrics_module.jax, "device_get", spy)
    m = TrainMetrics(cfg, _Artifacts(log))
    lines: list[str] = []
    for step in range(1, steps + 1):
        log.append(("dispatch", step))
        prov = {"batch_hash": f"h{step}", "record_ids": []}
        m.step_done(step, _outputs(step), prov, lines.append, sync=step in sync_at)
    return log, lines


def test_log_every_rows_are_fetched_after_the_next_step_is_dispatched(monkeypatch, tmp_path):
    log, lines = _drive(monkeypatch, tmp_path, log_every=2, steps=5, sync_at={5})
    assert log == [
        ("dispatch", 1),
        ("dispatch", 2),
        ("dispatch", 3),  # steps 1-2 are due at step 2 and fetched once step 3 is queued
        ("fetch", 2),
        ("rows", [1, 2], [{k: float(v) for k, v in _outputs(s).items()} for s in (1, 2)]),
        ("dispatch", 4),
        ("dispatch", 5),
        ("fetch", 2),
        ("rows", [3, 4], [{k: float(v) for k, v in _outputs(s).items()} for s in (3, 4)]),
        ("fetch", 1),  # a sync step (save, eval, end) is fetched at once
        ("rows", [5], [{k: float(v) for k, v in _outputs(5).items()}]),
    ]
    assert [line.split(" | ")[0] for line in lines] == ["step: 2", "step: 4", "step: 5"]
    assert lines[0].split(" | ")[1:3] == ["loss: 5.000", "grad_norm: 2.250"]


def test_every_step_logged_with_a_sync_every_step_is_fetched_at_once(monkeypatch, tmp_path):
    log, lines = _drive(monkeypatch, tmp_path, log_every=1, steps=3, sync_at={1, 2, 3})
    assert [e[0] for e in log] == ["dispatch", "fetch", "rows"] * 3
    assert [line.split(" | ")[0] for line in lines] == ["step: 1", "step: 2", "step: 3"]
