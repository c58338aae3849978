"""Which JAX platform a `runtime` process uses, chosen before jax starts.

Left to itself, JAX initialises every PJRT plugin that is installed. With the `dev` or `plan`
extras on a machine without an accelerator, that is 6-8 lines of CUDA probing
(`cudart_stub.cc … Could not find cuda drivers`), a traceback from the CUDA plugin ("Unable to
load CUDA") and libtpu's host-bounds warnings, on every command: output that looks like a failure
when nothing failed. So the platform is chosen deliberately from the devices this machine has,
and JAX_PLATFORMS names it (accelerator first, cpu as the host platform):

* a TPU (libtpu installed, and /dev/accel* (v2-v4) or /dev/vfio/N (v5e and later), as on a TPU
  VM or a GKE TPU pod): ``tpu,cpu``;
* an NVIDIA GPU (a CUDA plugin installed, and /dev/nvidia0 or a loaded driver): ``cuda,cpu``;
* an AMD GPU (a ROCm plugin installed, and /dev/kfd): ``rocm,cpu``;
* else ``cpu``.

A JAX_PLATFORMS the user (or a backend's rendered environment) set is kept as it is.

Choosing is not enough for CUDA: jaxlib imports the CUDA plugin's kernel modules at `import jax`
and JAX imports every advertised PJRT plugin when its first backend starts, whatever
JAX_PLATFORMS says, and each load of the plugin's libraries logs `cudart_stub.cc … Could not find
cuda drivers`. So when the platform in force names no GPU, `choose()` also keeps the CUDA plugin
out of this process (`hide_cuda_plugin`). `runtime plan`, which compiles for GPU targets through
that plugin without a GPU, lets it back in (`unhide_cuda_plugin`) before jax starts.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Iterator, MutableMapping
from concurrent.futures import wait

_chosen_here = False
_CUDA_MODULES = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_CUDA_PJRT = "jax_plugins.xla_cuda12"
_hidden: dict[str, types.ModuleType | None] = {}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _plugin(prefix: str) -> bool:
    """Whether a `jax_plugins.<prefix>*` PJRT plugin (or its standalone package) is installed."""
    if _installed(f"jax_{prefix}12_plugin") or _installed(f"jax_{prefix}13_plugin"):
        return True
    try:
        import jax_plugins  # type: ignore[import-not-found]
    except ImportError:
        return False
    import pkgutil

    return any(
        m.name.startswith(f"xla_{prefix}") for m in pkgutil.iter_modules(jax_plugins.__path__)
    )


def _tpu_here(root: str) -> bool:
    # The device files alone: TPU_* variables are also set off a TPU (`runtime plan` sets them
    # for libtpu's compile-only topologies), and a TPU VM or GKE TPU pod always has the files.
    if not _installed("libtpu"):
        return False
    devices = glob.glob(os.path.join(root, "dev/accel[0-9]*")) + [
        p for p in glob.glob(os.path.join(root, "dev/vfio/*")) if os.path.basename(p).isdigit()
    ]
    return bool(devices)


def _nvidia_here(root: str) -> bool:
    return _plugin("cuda") and (
        os.path.exists(os.path.join(root, "dev/nvidia0"))
        or os.path.exists(os.path.join(root, "proc/driver/nvidia/version"))
    )


def _rocm_here(root: str) -> bool:
    return _plugin("rocm") and os.path.exists(os.path.join(root, "dev/kfd"))


def detect(root: str = "/") -> str:
    """The JAX_PLATFORMS value for this machine's devices (see the module docstring)."""
    if _tpu_here(root):
        return "tpu,cpu"
    if _nvidia_here(root):
        return "cuda,cpu"
    if _rocm_here(root):
        return "rocm,cpu"
    return "cpu"


def choose(env: MutableMapping[str, str] | None = None) -> str:
    """Set JAX_PLATFORMS for this process unless it is set already; returns the value in force.
    Call before jax is imported: jax reads the variable once, at import."""
    global _chosen_here
    env = os.environ if env is None else env
    if not env.get("JAX_PLATFORMS"):
        env["JAX_PLATFORMS"] = detect()
        _chosen_here = True
    platforms = {p.strip().lower() for p in env["JAX_PLATFORMS"].split(",")}
    if not platforms & {"cuda", "gpu"}:
        hide_cuda_plugin()
    return env["JAX_PLATFORMS"]


def start_backend() -> None:
    """Start JAX's backend on a thread, so that the imports and file reads that come next run
    beside it: the TPU runtime took 8-13 s to come up on the v5e host, and its start leaves the
    GIL free about half the time (a main-thread Python loop kept 48% of its speed during it).
    Single-process runs only (`runtime local`): a job's hosts must form their cluster
    (`jax.distributed.initialize`) before any backend starts. An error is left for the main
    thread's own first call, which raises it where it is reported."""
    import jax  # imported here, on the calling thread: the thread below only starts the client

    from runfolder.background import in_background

    started = in_background(jax.devices, "jaxjob-backend-start")  # its error stays in the future
    # An exit (a refused config, a stop) must not finalise the interpreter under a client start;
    # registered after JAX's own exit handlers, so it runs before them.
    atexit.register(wait, [started])


def hide_cuda_plugin() -> None:
    """Keep the CUDA plugin out of this process (no-op once jax is imported: too late to matter,
    and jax may hold it). jaxlib skips kernel modules that fail to import; the PJRT plugin
    that the package advertises as an entry point is replaced by a module that registers no
    backend, since a missing one is reported as a configuration error."""
    if "jax" in sys.modules or _hidden:
        return
    for name in _CUDA_MODULES:
        _hidden[name] = None
        sys.modules[name] = None  # type: ignore[assignment]  # import of it raises ImportError
    pjrt = types.ModuleType(_CUDA_PJRT)
    pjrt.initialize = lambda: None  # type: ignore[attr-defined]  # registers nothing
    _hidden[_CUDA_PJRT] = pjrt
    sys.modules[_CUDA_PJRT] = pjrt


def unhide_cuda_plugin() -> None:
    """Undo `hide_cuda_plugin` (before jax is imported)."""
    for name, entry in list(_hidden.items()):
        if sys.modules.get(name, entry) is entry:
            sys.modules.pop(name, None)
        del _hidden[name]


def chosen_here() -> bool:
    """Whether `choose()` set JAX_PLATFORMS (rather than the user or a launcher)."""
    return _chosen_here


# What the CUDA plugin's libraries log when they load on a machine without an NVIDIA driver.
CUDA_PROBE_LINES = (
    "cudart_stub.cc",
    "All log messages before absl::InitializeLog() is called",
)


@contextlib.contextmanager
def dropping_native_lines(fragments: tuple[str, ...] = CUDA_PROBE_LINES) -> Iterator[None]:
    """Forward everything written to file descriptor 2 (C++ logging included) as it comes,
    except the lines that contain one of `fragments`. For `runtime plan` of a GPU target, which
    must load the CUDA plugin on a machine that has no GPU."""
    sys.stderr.flush()
    saved = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def forward() -> None:
        with os.fdopen(r, "rb") as src:
            for line in src:
                if not any(f.encode() in line for f in fragments):
                    os.write(saved, line)

    thread = threading.Thread(target=forward, name="jaxjob-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last writer: the thread reads to its end
        thread.join(timeout=5)
        os.close(saved)
