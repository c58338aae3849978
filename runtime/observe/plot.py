"""`runtime plot`: the training curves of one or several runs, as data or as one PNG. Reads only.

`plot_series` collects what the runs' records hold (train loss and learning rate per row,
tokens/s from the rows that carry timing, eval losses per eval name, the step of each resume);
`draw` renders them with matplotlib's Agg canvas (no pyplot, no display) into four panels that
share the x axis, one colour per run, each restart a dashed vertical line in its run's colour.
"""

from __future__ import annotations

import io
import os
from typing import Any, Literal

from jobspec.errors import StorageError
from jobspec.run_config import is_remote
from runfolder.layout import EVAL_METRICS, EVENTS, MANIFEST, TRAIN_METRICS, EventKind
from runfolder.storage import url_to_fs
from runfolder.store import ArtifactStore
from runfolder.view import open_run

Axis = Literal["step", "tokens"]
FIGSIZE = (12.0, 8.0)  # inches; at DPI the PNG is 1200 x 800 pixels
DPI = 100
EVAL_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
PLOT_FILE = "plots/curves.png"  # the default PNG, inside the first run's folder


def _rows(store: ArtifactStore, rel: str) -> list[dict]:
    return store.read_jsonl(rel) if store.exists(rel) else []


def run_series(run: str, x: Axis = "step") -> dict[str, Any]:
    """The curves of one run directory (local or gs://), x in steps or training tokens."""
    store = open_run(run)
    manifest = store.read_json(MANIFEST)
    train = _rows(store, TRAIN_METRICS)
    # Eval rows and events carry the step only: tokens are step x tokens_per_step.
    per_step = manifest.get("tokens_per_step") or (
        train[0]["tokens"] // max(train[0]["step"], 1) if train else 1
    )

    def at(step: int) -> int:
        return step if x == "step" else step * per_step

    timed = [r for r in train if "tokens_per_s" in r]
    evals: dict[str, dict[str, list]] = {}
    for r in _rows(store, EVAL_METRICS):
        e = evals.setdefault(r["name"], {"x": [], "loss": []})
        e["x"].append(at(r["step"]))
        e["loss"].append(r["loss"])
    return {
        "run": store.uri(""),
        "run_id": manifest.get("run_id"),
        "train": {
            "x": [r[x] for r in train],
            "loss": [r.get("loss") for r in train],
            "lr": [r.get("lr") for r in train],
        },
        "throughput": {
            "x": [r[x] for r in timed],
            "tokens_per_s": [r["tokens_per_s"] for r in timed],
        },
        "eval": evals,
        "restarts": [
            at(e["step"]) for e in _rows(store, EVENTS) if e.get("event") == EventKind.RESUME
        ],
    }


def plot_series(runs: list[str], x: Axis = "step") -> dict[str, Any]:
    """The curves of every run in `runs`, in order; a run that is not a run directory raises
    StorageError (one sentence)."""
    return {"x": x, "runs": [run_series(r, x) for r in runs]}


def _labels(runs: list[dict]) -> list[str]:
    """Run ids, made unique by their URI when two runs share one."""
    ids = [str(r["run_id"]) for r in runs]
    return [i if ids.count(i) == 1 else f"{i} ({r['run']})" for i, r in zip(ids, runs, strict=True)]


def render_png(series: dict[str, Any]) -> bytes:
    """The four panels as PNG bytes: train loss, eval loss, learning rate, tokens/s."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True)
    loss_ax, eval_ax, lr_ax, tps_ax = axes.flat
    titles = ("train loss (eval points as markers)", "eval loss", "learning rate", "tokens/s")
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training tokens" if series["x"] == "tokens" else "step")
        if series["x"] == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())
    tps_ax.yaxis.set_major_formatter(EngFormatter())

    names = sorted({n for r in series["runs"] for n in r["eval"]})
    marker = {n: EVAL_MARKERS[i % len(EVAL_MARKERS)] for i, n in enumerate(names)}
    handles = []
    n, labels = len(series["runs"]), _labels(series["runs"])
    for i, run in enumerate(series["runs"]):
        colour, train, tp = f"C{i % 10}", run["train"], run["throughput"]
        lw = 1.2 + 1.2 * (n - 1 - i) / max(n - 1, 1)  # earlier runs wider: equal curves stay seen
        loss_ax.plot(train["x"], train["loss"], color=colour, lw=lw)
        lr_ax.plot(train["x"], train["lr"], color=colour, lw=lw)
        tps_ax.plot(tp["x"], tp["tokens_per_s"], color=colour, lw=1.0, marker=".", ms=4)
        for name, e in run["eval"].items():
            style = {"color": colour, "marker": marker[name], "ms": 6, "mec": "black", "mew": 0.6}
            loss_ax.plot(e["x"], e["loss"], ls="none", zorder=3, **style)
            eval_ax.plot(e["x"], e["loss"], ls="-", lw=1.0, **style)
        for at in run["restarts"]:
            for ax in axes.flat:
                ax.axvline(at, color=colour, ls="--", lw=1.0, alpha=0.7)
        handles.append(Line2D([], [], color=colour, lw=2, label=labels[i]))

    handles += [
        Line2D([], [], color="grey", ls="none", marker=marker[n], mec="black", label=f"eval {n}")
        for n in names
    ]
    if any(r["restarts"] for r in series["runs"]):
        handles.append(Line2D([], [], color="grey", ls="--", label="restart (resume)"))
    empty = {
        loss_ax: not any(r["train"]["x"] for r in series["runs"]),
        eval_ax: not names,
        lr_ax: not any(r["train"]["x"] for r in series["runs"]),
        tps_ax: not any(r["throughput"]["x"] for r in series["runs"]),
    }
    for ax, nothing in empty.items():
        if nothing:
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 5), fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def draw(series: dict[str, Any], out_path: str) -> str:
    """Write the PNG of `series` to `out_path` (local, parents created, or gs://); its URI."""
    png = render_png(series)
    fs, path = url_to_fs(out_path)
    try:
        if not is_remote(out_path):
            parent = os.path.dirname(path)
            if parent:
                fs.makedirs(parent, exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(png)
    except OSError as e:
        raise StorageError(f"cannot write {out_path}: {e.strerror or e}") from e
    return out_path
