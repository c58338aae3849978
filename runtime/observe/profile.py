"""`[profile]`: a jax.profiler trace of steps start_step..last_step on every host.

The trace is taken into a local folder, then copied through the run's store to
`<run>/profile/host-<i>/` (so gs:// works), where XProf or TensorBoard's profile plugin read it
(`plugins/profile/<time>/<host>.xplane.pb`). The capture is an event; the loop keeps the traced
steps out of tokens/s.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable

import jax

from jobspec.run_config import ProfileConfig
from runfolder.layout import PROFILE, profile_dir
from runfolder.store import ArtifactStore


class ProfileWindow:
    """Starts the trace before `start_step` runs and stops it once `last_step` is done."""

    def __init__(self, cfg: ProfileConfig | None, store: ArtifactStore, start_step: int):
        self.cfg = cfg
        self.store = store
        # A resumed attempt that starts inside or past the window traces nothing: its steps
        # would not be the ones asked for.
        self.enabled = cfg is not None and start_step < cfg.start_step
        self._dir: str | None = None
        self._t0 = 0.0

    def starts_after(self, step: int) -> bool:
        """True when the step after `step` is the first traced (the loop syncs there)."""
        return self.enabled and self.cfg is not None and step + 1 == self.cfg.start_step

    def active(self, step: int) -> bool:
        """Whether `step` runs inside the trace."""
        return self._dir is not None or (
            self.enabled and self.cfg is not None and step == self.cfg.start_step
        )

    def ends_at(self, step: int) -> bool:
        return self._dir is not None and self.cfg is not None and step == self.cfg.last_step

    def start(self, step: int, emit: Callable[[str], None]) -> None:
        """Before `step` runs: start tracing if it is the window's first step."""
        if not (self.enabled and self.cfg is not None and step == self.cfg.start_step):
            return
        self._dir = tempfile.mkdtemp(prefix="jaxjob-profile-")
        self._t0 = time.perf_counter()
        jax.profiler.start_trace(self._dir)
        emit(f"profiling steps {self.cfg.start_step}..{self.cfg.last_step}")

    def stop(self, step: int, outputs, emit: Callable[[str], None]) -> dict | None:
        """After `step`: once the window's last step is done, stop, copy the trace to the run,
        and return the event fields (None when nothing was stopped)."""
        if not self.ends_at(step) or self._dir is None or self.cfg is None:
            return None
        jax.block_until_ready(outputs)  # the traced steps' device work belongs in the trace
        traced_s = time.perf_counter() - self._t0
        jax.profiler.stop_trace()
        local, self._dir, self.enabled = self._dir, None, False
        try:
            dest = profile_dir(self.store.process_index)
            files = _copy_tree(local, self.store, dest)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        emit(f"profile of steps {self.cfg.start_step}..{step} written to {self.store.uri(dest)}")
        return {
            "start_step": self.cfg.start_step,
            "last_step": step,
            "seconds": traced_s,
            "path": self.store.uri(PROFILE),
            "files": files,
        }

    def abandon(self) -> None:
        """The attempt ends inside the window (a signal, --max-steps): stop without copying."""
        if self._dir is not None:
            try:
                jax.profiler.stop_trace()
            finally:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def _copy_tree(local: str, store: ArtifactStore, dest: str) -> list[str]:
    """Every file under `local` to `dest/<same relative path>` in the run; returns those paths."""
    out = []
    for root, _, names in os.walk(local):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = f"{dest}/{os.path.relpath(path, local)}"
            with open(path, "rb") as f:
                store.write_own_bytes(rel, f.read())
            out.append(rel)
    return out
