"""`launch logs --since D --timestamps --attempt N`.

--attempt N reads attempt N's host logs from the run folder (`<run>/logs/attempt-N/host-<i>.log`,
runtime/host/hostlog.py), on every backend whose run storage this machine can read.

--since and --timestamps need the time each line was written. The host logs do not record it:
hostlog.py tees each host's stdout/stderr bytes as they come, with no time per line, and the
backends read those files (local, slurm, and k8s once its pods are gone). Rather than guess a
line's time (from a file's modification time, say), both options say so in one sentence and
exit 2; their values are still checked first, so a typo is named as such.
"""

from __future__ import annotations

from collections.abc import Iterator

from jobspec.errors import JaxjobError


def refuse_line_times(run_id: str, backend: str, option: str) -> None:
    """The one sentence for --since/--timestamps: no backend's host logs carry line times."""
    raise JaxjobError(
        f"{option}: run {run_id}'s host logs ({backend}) do not record when each line was "
        "written (they are a plain copy of each host's output), so they cannot be shown by "
        "time; use --tail K or --attempt N instead"
    )


def attempts(run_uri: str) -> list[int]:
    """The attempts with a host-log folder in the run folder, in order."""
    from runfolder.layout import LOGS, parse_host_log
    from runfolder.storage import join, url_to_fs

    fs, path = url_to_fs(join(run_uri, LOGS))
    if not fs.exists(path):
        return []
    found = (parse_host_log(p) for p in fs.ls(path, detail=False))
    return sorted(f[0] for f in found if f is not None and f[1] is None)


def attempt_lines(
    run_uri: str, run_id: str, attempt: int, *, host: int | None, tail: int | None
) -> Iterator[str]:
    """Attempt `attempt`'s host log lines from the run folder, host by host, each prefixed
    `[host N] ` (as every backend's logs); `tail`: the last K lines of each host."""
    from runfolder.layout import LOGS, parse_host_log
    from runfolder.storage import PARTS_SUFFIX, join, read_parted, url_to_fs

    have = attempts(run_uri)
    if attempt not in have:
        said = f"it has attempts {', '.join(map(str, have))}" if have else "it has no host logs yet"
        raise JaxjobError(f"--attempt {attempt}: run {run_id} has no such attempt; {said}")
    fs, folder = url_to_fs(join(run_uri, LOGS, f"attempt-{attempt}"))
    # On object stores a host log is parts, `host-<i>.log.parts/000000.log`, …: read in order.
    files = sorted(
        {
            (found[1], log)
            for p in fs.ls(folder, detail=False)
            if (found := parse_host_log(log := p.rstrip("/").removesuffix(PARTS_SUFFIX)))
            and found[1] is not None
            and (host is None or found[1] == host)
        }
    )
    for h, p in files:
        lines = read_parted(fs, p).decode(errors="replace").splitlines()
        if tail is not None:
            lines = lines[len(lines) - tail :] if tail else []
        for line in lines:
            yield f"[host {h}] {line}"
