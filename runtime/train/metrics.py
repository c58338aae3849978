"""Train-metric rows and the live line. Timing comes only from explicit synchronisation points."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jobspec.goodput import duration


@dataclass
class Throughput:
    """Tokens/s and step time over the steps between two synchronisation points."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # whole job: per-chip peak x chips; None = MFU not reported
    started: float = field(default_factory=time.perf_counter)
    _last_time: float | None = None
    _last_step: int | None = None

    def mark(self, step: int) -> None:
        """Call right after a host sync (device_get) at `step`: opens the next interval."""
        self._last_time, self._last_step = time.perf_counter(), step

    def interval(self, step: int) -> dict[str, float] | None:
        """Figures for the steps since the last mark; None before the first mark."""
        now = time.perf_counter()
        if self._last_time is None or self._last_step is None or step <= self._last_step:
            return None
        steps = step - self._last_step
        dt = now - self._last_time
        tps = steps * self.tokens_per_step / dt
        out = {"step_time": dt / steps, "tokens_per_s": tps, "elapsed": now - self.started}
        if self.peak_flops:
            out["mfu"] = tps * self.flops_per_token / self.peak_flops
        self._last_time, self._last_step = now, step
        return out


def live_line(row: dict) -> str:
    """`step: 10 | loss: 5.247 | grad_norm: 1.155 | lr: 2.9e-04 | tps: 59,660 | elapsed: 39.8s |
    eta: 4m10s`."""
    parts = [
        f"step: {row['step']}",
        f"loss: {row['loss']:.3f}",
        f"grad_norm: {row['grad_norm']:.3f}",
        f"lr: {row['lr']:.1e}",
    ]
    if "pg_clip_fraction" in row:
        parts.append(f"clipped: {100 * row['pg_clip_fraction']:.1f}%")
    if "tokens_per_s" in row:
        parts.append(f"tps: {row['tokens_per_s']:,.0f}")
    if "mfu" in row:
        parts.append(f"mfu: {100 * row['mfu']:.1f}%")
    if "elapsed" in row:
        parts.append(f"elapsed: {row['elapsed']:.1f}s")
    if row.get("eta_s"):
        parts.append(f"eta: {duration(row['eta_s'])}")
    return " | ".join(parts)


def eval_line(
    step: int, name: str, loss: float, tokens: float, per_source: dict | None = None
) -> str:
    """`eval validation @ step 300 | loss: 2.267 | tokens: 8,192`; over a mixture the sources'
    losses follow the mixed one: `loss: 2.267 (web 2.310, code 1.870)` (`-`: no tokens)."""
    mixed = f"{loss:.3f}"
    if per_source:
        each = ", ".join(
            f"{n} {'-' if v is None else format(v, '.3f')}" for n, v in per_source.items()
        )
        mixed += f" ({each})"
    return f"eval {name} @ step {step} | loss: {mixed} | tokens: {tokens:,.0f}"
