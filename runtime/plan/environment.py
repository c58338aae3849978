"""The process environment a plan compiles in, set before jax starts (jax-free)."""

from __future__ import annotations

import os

from jobspec.errors import ConfigError


def prepare_environment(accelerator: str) -> None:
    """Before jax starts: no chip probing (compile-only devices need no platform), and no
    libtpu lock (compile-only TPU devices touch no chip, so a training process holding the lock
    on a TPU VM must not stop a plan). A target whose compiler is missing is one sentence."""
    from runtime.host import platform

    if platform.chosen_here() or not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"  # a platform chosen for training is not the plan's
    if is_gpu(accelerator):
        platform.unhide_cuda_plugin()  # GPU targets compile through the CUDA plugin
    check_compiler(accelerator)  # after the unhide: the plugin it hid is there
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Compile-only executables cannot be loaded without a client, so a persistent compilation
    # cache only warns on a plan's second run ("PjRtCompiler must be constructed with a Client").
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # libtpu describes the local TPU host when it loads; off a TPU VM it logs a page of
    # warnings (and an INVALID_ARGUMENT it recovers from) unless told there is one host and no
    # metadata server. Compile-only topologies do not use these values.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")


def is_gpu(accelerator: str) -> bool:
    from jobspec.hardware.catalogue import lookup

    try:
        return lookup(accelerator).kind == "gpu"
    except ConfigError:
        return False  # resolve_target says what is wrong with the name


# What compiles for each kind of target, and the extra that installs it (pyproject.toml).
_COMPILERS = {
    "tpu": {"libtpu": "libtpu"},
    "gpu": {
        "jax_cuda12_plugin": "jax-cuda12-plugin",
        "jax_plugins.xla_cuda12": "jax-cuda12-pjrt",
        "nvidia.cudnn": "nvidia-cudnn-cu12",
    },
}


def check_compiler(accelerator: str) -> None:
    """One sentence naming the `plan` extra when the target's compiler is not installed (JAX
    would say it in a 40-line traceback at the first compile)."""
    from jobspec.extras import require
    from jobspec.hardware.catalogue import lookup

    try:
        kind = lookup(accelerator).kind
    except ConfigError:
        return  # resolve_target says what is wrong with the name
    if kind in _COMPILERS:
        require(_COMPILERS[kind], "plan", f"runtime plan for {accelerator}")
