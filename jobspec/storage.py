"""fsspec filesystems for local paths and gs:// URIs, with the GCS emulator settings applied.

Every module that touches files resolves them here, so a local path and gs:// behave the same.
"""

from __future__ import annotations

import os

import fsspec

from jobspec.errors import StorageError


def configure_gcs_env() -> None:
    """Point every GCS client (gcsfs, tensorstore, google-cloud-storage) at the emulator if one is set.

    Real GCS needs nothing here. With STORAGE_EMULATOR_HOST set, tensorstore needs its own URL
    variable, and gcsfs must skip its gRPC bucket-layout probe that the emulator never answers.
    """
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    if not host.startswith("http"):
        host = "http://" + host
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("EPATH_USE_TF", "false")


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def url_to_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path-within-it) for a local path or URI; gs:// needs the `gcs` extra."""
    configure_gcs_env()
    kwargs: dict = {}
    if uri.startswith(("gs://", "gcs://")):
        try:
            import gcsfs  # noqa: F401
        except ImportError as e:
            raise StorageError(
                f"{uri} is a gs:// URI but gcsfs is not installed; install jaxjob with the 'gcs' extra "
                "(pip install 'jaxjob[gcs]')"
            ) from e
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            kwargs["token"] = "anon"
            kwargs["endpoint_url"] = (
                emulator if emulator.startswith("http") else "http://" + emulator
            )
    try:
        return fsspec.core.url_to_fs(uri, **kwargs)
    except (ValueError, ImportError) as e:
        raise StorageError(f"cannot open {uri}: {e}") from e
