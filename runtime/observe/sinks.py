"""`[metrics]` sinks: TensorBoard event files and W&B, fed the rows the run writes to JSONL.

The JSON records stay the source of truth: a sink gets each row after it is written, so a sink
never disagrees with metrics/train.jsonl or metrics/eval.jsonl. Only the writer host has sinks.
A sink that fails (no network, no key, a missing package, a full disk) says so in one warning
and turns itself off; the run goes on.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from jobspec.run_config import MetricsConfig, WandbConfig
from runfolder.layout import TENSORBOARD, WANDB
from runfolder.store import ArtifactStore

# Row fields that are not scalars to plot against the step.
NOT_SCALARS = {"step", "tokens", "batch_hash", "record_ids", "name", "time", "elapsed"}
UPLOAD_EVERY_S = 30.0  # gs:// runs: event files are copied to the run at most this often


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def scalars(row: dict[str, Any], prefix: str) -> dict[str, float]:
    """`prefix/<field>` for every numeric field of a row (bools and ids left out); a table of
    numbers (tokens_per_source) is `prefix/<field>/<key>`."""
    out = {}
    for k, v in row.items():
        if k in NOT_SCALARS:
            continue
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}/{k}"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}/{k}"] = float(v)
    return out


PER_SOURCE = "_per_source"  # a mixture eval's tables: loss_per_source, token_count_per_source, …


def eval_scalars(row: dict[str, Any]) -> dict[str, float]:
    """`eval/<name>/<field>`; a mixture eval's `<field>_per_source` tables beside their total,
    `eval/<name>/<field>/<source>` (eval/val/loss and eval/val/loss/web, …)."""
    prefix = f"eval/{row.get('name', 'eval')}"
    flat = {k: v for k, v in row.items() if not (k.endswith(PER_SOURCE) and isinstance(v, dict))}
    out = scalars(flat, prefix)
    for k, v in row.items():
        if k not in flat:
            out.update(scalars(v, f"{prefix}/{k.removesuffix(PER_SOURCE)}"))
    return out


class _Sink:
    name = "sink"

    def __init__(self) -> None:
        self.on = True

    def _guard(self, what: str, fn, *args) -> None:
        if not self.on:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a sink never fails the run
            self.on = False
            _warn(f"the {self.name} sink is off: {what} failed ({type(e).__name__}: {e})")
            try:
                self._abandon()
            except Exception:  # noqa: BLE001 - already said
                pass

    def _abandon(self) -> None:
        """Best effort after a failure: keep what was logged before it."""

    def log(self, step: int, values: dict[str, float]) -> None:
        self._guard("logging", self._log, step, values)

    def close(self) -> None:
        self._guard("closing", self._close)

    def _log(self, step: int, values: dict[str, float]) -> None: ...

    def _close(self) -> None: ...


class TensorBoardSink(_Sink):
    """Event files under <run>/tensorboard/, written by tensorboardX.

    A local run writes there directly; a gs:// run writes a local copy and uploads the files
    through the store. A resumed attempt starts its file with a purge at its first step, so
    TensorBoard drops the rows the earlier attempt logged past the checkpoint (as train.jsonl
    does)."""

    name = "TensorBoard"

    def __init__(self, store: ArtifactStore, start_step: int) -> None:
        super().__init__()
        from tensorboardX import SummaryWriter

        self.store = store
        self.local = (
            store.uri(TENSORBOARD) if not store.remote else tempfile.mkdtemp(prefix="jaxjob-tb-")
        )
        self._uploaded = 0.0
        self.writer = SummaryWriter(
            logdir=self.local,
            purge_step=start_step + 1 if start_step else None,
            flush_secs=10,
            # The default name (seconds, host) repeats for two attempts in the same second, and
            # TensorBoard reads a folder's files in name order: nanoseconds keep attempts in order.
            filename_suffix=f".{time.time_ns()}.{os.getpid()}",
        )

    def _log(self, step: int, values: dict[str, float]) -> None:
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, global_step=step)
        if self.store.remote and time.monotonic() - self._uploaded > UPLOAD_EVERY_S:
            self._upload()

    def _upload(self) -> None:
        self.writer.flush()
        for name in sorted(os.listdir(self.local)):
            with open(os.path.join(self.local, name), "rb") as f:
                self.store.write_bytes(f"{TENSORBOARD}/{name}", f.read())
        self._uploaded = time.monotonic()

    def _abandon(self) -> None:
        self.writer.close()

    def _close(self) -> None:
        self.writer.close()
        if self.store.remote:
            try:
                self._upload()
            finally:
                shutil.rmtree(self.local, ignore_errors=True)


class WandbSink(_Sink):
    """W&B, on a thread of its own: the run never waits on its network or its start-up.

    Rows carry their step as the metric `step` (W&B's own step counter only counts calls), so a
    resumed attempt's rows land where they belong. Offline runs go to <run>/wandb/ (a gs:// run's
    are uploaded there at the end) for `wandb sync`."""

    name = "W&B"
    CLOSE_TIMEOUT_S = 120.0

    def __init__(self, cfg: WandbConfig, store: ArtifactStore, run_id: str, config: dict) -> None:
        super().__init__()
        self.cfg, self.store = cfg, store
        # W&B writes its runs into `<dir>/wandb/`: the run's own folder, or a local stand-in.
        self.local = store.uri() if not store.remote else tempfile.mkdtemp(prefix="jaxjob-wandb-")
        self._rows: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(run_id, config), name="jaxjob-wandb", daemon=True
        )
        self._thread.start()

    def _log(self, step: int, values: dict[str, float]) -> None:
        self._rows.put((step, values))

    def _run(self, run_id: str, config: dict) -> None:
        try:
            run = self._init(run_id, config)
        except Exception as e:  # noqa: BLE001 - a sink never fails the run
            self.on = False
            _warn(f"the W&B sink is off: it could not start ({type(e).__name__}: {e})")
            return
        while (item := self._rows.get()) is not None:
            step, values = item
            try:
                run.log({"step": step, **values})
            except Exception as e:  # noqa: BLE001
                self.on = False
                _warn(f"the W&B sink is off: logging failed ({type(e).__name__}: {e})")
                return
        try:
            run.finish()
        except Exception as e:  # noqa: BLE001
            _warn(f"W&B could not finish its run ({type(e).__name__}: {e})")

    def _init(self, run_id: str, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError("wandb is not installed (pip install 'jaxjob[wandb]')") from e
        if self.cfg.mode == "online" and not _has_wandb_key():
            raise RuntimeError("no W&B API key: set WANDB_API_KEY or run `wandb login`")
        run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            mode=self.cfg.mode,
            dir=self.local,
            id=run_id,
            name=run_id,
            # Online, a resumed attempt continues the same W&B run; offline runs cannot resume.
            resume="allow" if self.cfg.mode == "online" else None,
            config=config,
            # Our hosts' own log capture owns stdout/stderr; W&B must not wrap them.
            settings=wandb.Settings(console="off", silent=True, init_timeout=60),
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def _close(self) -> None:
        self._rows.put(None)
        self._thread.join(self.CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            _warn(f"W&B did not finish within {self.CLOSE_TIMEOUT_S:.0f}s; leaving it behind")
            return
        if self.store.remote:
            try:
                for root, _, names in os.walk(os.path.join(self.local, WANDB)):
                    for name in names:
                        path = os.path.join(root, name)
                        rel = os.path.relpath(path, self.local)
                        with open(path, "rb") as f:
                            self.store.write_bytes(rel, f.read())
            finally:
                shutil.rmtree(self.local, ignore_errors=True)


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc) as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


def sink_check(cfg: MetricsConfig) -> str | None:
    """What `runtime preflight` says of the configured sinks: None if none is configured; raises
    RuntimeError naming the sink that would be off (the run itself would go on)."""
    names = []
    if cfg.tensorboard:
        import tensorboardX  # noqa: F401 - a core dependency; its absence is a broken install

        names.append("TensorBoard")
    if cfg.wandb is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "W&B would be off: wandb is not installed (pip install 'jaxjob[wandb]'); "
                "the run trains without it"
            ) from None
        if cfg.wandb.mode == "online" and not _has_wandb_key():
            raise RuntimeError(
                "W&B would be off: no API key (set WANDB_API_KEY or run `wandb login`, or use "
                "mode = 'offline'); the run trains without it"
            )
        names.append(f"W&B {cfg.wandb.mode} (project {cfg.wandb.project})")
    return ", ".join(names) or None


class MetricSinks:
    """The configured sinks of one attempt (none on a host that is not the writer)."""

    def __init__(self, sinks: list[_Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def open(
        cls, cfg: MetricsConfig, store: ArtifactStore, *, run_id: str, start_step: int,
        config: dict,
    ) -> MetricSinks:  # fmt: skip
        if not store.is_writer:
            return cls([])
        sinks: list[_Sink] = []
        if cfg.tensorboard:
            try:
                sinks.append(TensorBoardSink(store, start_step))
            except Exception as e:  # noqa: BLE001
                _warn(f"the TensorBoard sink is off: it could not start ({type(e).__name__}: {e})")
        if cfg.wandb is not None:
            sinks.append(WandbSink(cfg.wandb, store, run_id, config))
        return cls(sinks)

    def train_rows(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            values = scalars(row, "train")
            for s in self.sinks:
                s.log(row["step"], values)

    def eval_row(self, row: dict[str, Any]) -> None:
        values = eval_scalars(row)
        for s in self.sinks:
            s.log(row["step"], values)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
