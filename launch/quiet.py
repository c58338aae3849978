"""The quiet view of a multi-host job's output.

Every host of a job prints the same training lines, so the plain view of a 64-host job shows
each step line 64 times. The quiet view shows the lead host's lines (host 0), and of the other
hosts only their warning and error lines. A warning said by several hosts is shown once, marked
with how many hosts said it: `[3 hosts: 0-2] WARNING: ...`. Lines come in as the backends yield
them, prefixed `[host N] `; lines without that prefix pass through unchanged.

Two modes:

- `quiet_lines(lines)`: a complete list (`launch logs` without --follow). Grouped over the whole
  list: host 0's lines in order, a warning of host 0 that others also said carries the count;
  another host's warning is shown once, where it first appears, unless host 0 said it too.
- `QuietStream` (`launch logs --follow`, `launch submit --wait`): host 0's ordinary lines are
  emitted at once; a warning is held until every host said it or `window` seconds passed, then
  emitted once with its count. `follow_quiet` drives one over a blocking line iterator, so held
  lines come out on time even while no new line arrives.

A warning/error line: a word warning/warn/error/exception/traceback/fatal/critical (any case),
or a Python class name ending in Error/Exception/Warning (`ValueError`); absl/glog lines
(`W1206 01:02:03.123456  1234 file.cc:12] ...`) by their level only: W, E and F are, I is not.
For identity the glog time and thread id, and a leading ISO timestamp, are ignored. A Python
traceback (`Traceback (most recent call last):`, its indented lines and the exception line) is
one item, so the same traceback from several hosts is shown once, whole.

A line may carry its time first, before its host (`launch logs --timestamps`:
`2026-12-07T23:01:02.345Z [host 3] ...`, as kubectl puts it): it is grouped as the same line
without the time, and a line shown once for several hosts carries the earliest of their times
(for the k-th time hosts said it, the earliest host's k-th time).

Native libraries' notices that say nothing a user acts on (gloo's "[Gloo] Rank 0 is connected
to 1 peer ranks ..." on CPU clusters) are left out of the quiet view like another host's
ordinary lines, and counted apart ("2 library notice(s)"); --all-hosts and --host N show them.

Pure: no clock or I/O of its own (`follow_quiet` takes the clock and runs the source in a
thread); `launch` must not import jax, and this imports only the standard library.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

LEAD = 0  # the host whose lines the quiet view shows
WINDOW_S = 2.0  # how long a warning waits for the other hosts to say it too
MAX_RANGE_PARTS = 8  # `[n hosts: ...]` lists at most this many ranges, then "..."

_HOST = re.compile(r"\[host (\d+)\] ?")
# `launch logs --timestamps`: RFC 3339 UTC with milliseconds, before the host prefix.
_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?=\[host \d+\])")
# absl/glog: level, MMDD, time, thread id, then `file.cc:12] message`.
_GLOG = re.compile(r"([IWEF])\d{4} [\d:.]+\s+\d+\s+(.*)", re.S)
_ISO_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\s*")
_WORDS = re.compile(
    r"\b(?:warn|warning|warnings|error|errors|exception|exceptions|traceback|fatal|critical)\b"
    r"|\b[A-Za-z_]\w*(?:Error|Exception|Warning)\b",
    re.I,
)
_TRACEBACK = "Traceback (most recent call last):"
# Native libraries' notices left out of the quiet view (see the module doc).
_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")

Key = tuple[str, ...]


def split_host(line: str) -> tuple[int | None, str]:
    """(host, text) of a `[host N] text` line; (None, line) when it has no host prefix."""
    m = _HOST.match(line)
    if m is None:
        return None, line
    return int(m.group(1)), line[m.end() :]


def split_stamp(line: str) -> tuple[str | None, str]:
    """(time, rest) of a `<time> [host N] text` line (--timestamps); (None, line) without one."""
    m = _STAMP.match(line)
    if m is None:
        return None, line
    return m.group(1), line[m.end() :]


def _earliest(stamps: Iterable[tuple[str | None, ...]]) -> tuple[str | None, ...] | None:
    """The times of the item said first (times of one format sort as strings); None if none."""
    timed = [s for s in stamps if s and s[0] is not None]
    return min(timed, key=lambda s: s[0] or "") if timed else None


def is_warning(text: str) -> bool:
    """Whether a line (without its host prefix) is a warning or an error."""
    g = _GLOG.match(text)
    if g is not None:
        return g.group(1) != "I"
    return _WORDS.search(text) is not None


def is_chatter(text: str) -> bool:
    """Whether a line (without its host prefix) is a native library's notice (module doc)."""
    return _CHATTER.match(text) is not None


def line_key(text: str) -> str:
    """What identical lines of different hosts share: the glog time and thread id, a leading ISO
    timestamp and trailing blanks left out."""
    text = text.rstrip()
    g = _GLOG.match(text)
    if g is not None:
        return f"{g.group(1)} {g.group(2)}"
    return _ISO_TIME.sub("", text, count=1) if _ISO_TIME.match(text) else text


def host_ranges(hosts: Iterable[int]) -> str:
    """`0-63`, `0,1`, `0-3,7,9-12`: sorted hosts, runs of three or more as ranges."""
    xs = sorted(set(hosts))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}-{xs[j]}")
        else:
            parts += [str(x) for x in xs[i : j + 1]]
        i = j + 1
    if len(parts) > MAX_RANGE_PARTS:
        parts = [*parts[:MAX_RANGE_PARTS], "..."]
    return ",".join(parts)


def marker(hosts: Iterable[int]) -> str:
    """`[host 3]` for one host, `[2 hosts: 0,1]` for several."""
    hs = set(hosts)
    if len(hs) == 1:
        return f"[host {next(iter(hs))}]"
    return f"[{len(hs)} hosts: {host_ranges(hs)}]"


@dataclass
class Hidden:
    """What the quiet view left out: the ordinary (not warning) lines of the other hosts."""

    lines: int = 0
    hosts: set[int] = field(default_factory=set)
    notices: int = 0  # native libraries' notices, of any host

    def add(self, host: int, n: int = 1) -> None:
        self.lines += n
        self.hosts.add(host)

    def note(self) -> str:
        """One sentence for stderr, or "" when nothing was left out."""
        parts = []
        if self.lines:
            who = "host" if len(self.hosts) == 1 else "hosts"
            parts.append(f"{self.lines} ordinary line(s) of {who} {host_ranges(self.hosts)}")
        if self.notices:
            parts.append(f"{self.notices} library notice(s)")
        if not parts:
            return ""
        return (
            f"(quiet view: {' and '.join(parts)} not shown; --all-hosts shows every host's lines)"
        )


@dataclass
class _Item:
    """One line, or one whole Python traceback, of one host."""

    host: int
    texts: list[str]
    warning: bool
    key: Key = ()
    chatter: bool = False
    stamps: tuple[str | None, ...] = ()  # each text's time (--timestamps), or none

    def __post_init__(self) -> None:
        if not self.key:
            self.key = tuple(line_key(t) for t in self.texts)

    def render(
        self, hosts: Iterable[int], stamps: tuple[str | None, ...] | None = None
    ) -> list[str]:
        """Each text prefixed with the hosts' marker, and its time first when it has one
        (`stamps`: the times to show instead of its own, e.g. another host's earlier ones)."""
        m = marker(hosts)
        times = stamps if stamps is not None else self.stamps
        times = (tuple(times) + (None,) * len(self.texts))[: len(self.texts)]
        return [f"{s} {m} {t}" if s else f"{m} {t}" for s, t in zip(times, self.texts, strict=True)]


@dataclass
class _Block:
    """A traceback being read: from its header to the exception line."""

    texts: list[str]
    last: float
    stamps: list[str | None] = field(default_factory=list)


class _Splitter:
    """Turns one host's lines into items: a line, or a traceback with all its lines."""

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}

    def feed(self, host: int, text: str, now: float = 0.0, stamp: str | None = None) -> list[_Item]:
        out: list[_Item] = []
        block = self.blocks.get(host)
        if block is not None:
            if text[:1].isspace():  # a frame of the traceback
                block.texts.append(text)
                block.stamps.append(stamp)
                block.last = now
                return out
            if text.strip():  # the exception line ends it
                block.texts.append(text)
                block.stamps.append(stamp)
                out.append(self.close(host))
                return out
            out.append(self.close(host))  # a blank line ends it; the blank line is its own
        if text.startswith(_TRACEBACK):
            self.blocks[host] = _Block([text], now, [stamp])
            return out
        chatter = is_chatter(text)
        warning = is_warning(text) and not chatter
        out.append(_Item(host, [text], warning, chatter=chatter, stamps=(stamp,)))
        return out

    def close(self, host: int) -> _Item:
        block = self.blocks.pop(host)
        return _Item(host, block.texts, warning=True, stamps=tuple(block.stamps))

    def close_stale(self, before: float) -> list[_Item]:
        """Tracebacks whose last line came before `before` (a host that stopped mid-way)."""
        return [self.close(h) for h, b in list(self.blocks.items()) if b.last <= before]

    def close_all(self) -> list[_Item]:
        return [self.close(h) for h in list(self.blocks)]


def quiet_lines(lines: Iterable[str], hidden: Hidden | None = None) -> list[str]:
    """The quiet view of a complete list of lines (see the module doc). The lead is host 0, or
    the lowest host when host 0 has no line. `hidden`, when given, counts what was left out."""
    hidden = hidden if hidden is not None else Hidden()
    split = _Splitter()
    items: list[_Item | str] = []  # str: a line without a host prefix, kept as it is
    for line in lines:
        stamp, rest = split_stamp(line)
        host, text = split_host(rest)
        if host is None:
            items.append(line)
        else:
            items += split.feed(host, text, stamp=stamp)
    items += split.close_all()
    hosts_of: dict[Key, set[int]] = {}
    # Each host's sayings of each warning, in order: the k-th of them go together (for times).
    said: dict[Key, dict[int, list[_Item]]] = {}
    nth: dict[int, int] = {}  # id(item) -> k: the how-manyth time its host said it
    present: set[int] = set()
    for it in items:
        if isinstance(it, _Item):
            present.add(it.host)
            if it.warning:
                hosts_of.setdefault(it.key, set()).add(it.host)
                mine = said.setdefault(it.key, {}).setdefault(it.host, [])
                nth[id(it)] = len(mine)
                mine.append(it)

    def grouped(it: _Item) -> list[str]:
        by_host = said[it.key]
        k = nth[id(it)]
        peers = (xs[k].stamps for xs in by_host.values() if k < len(xs))
        return it.render(hosts_of[it.key], _earliest(peers))

    lead = LEAD if LEAD in present or not present else min(present)
    out: list[str] = []
    shown: set[Key] = set()
    for it in items:
        if isinstance(it, str):
            out.append(it)
        elif it.chatter:
            hidden.notices += len(it.texts)
        elif it.host == lead:
            out += grouped(it) if it.warning else it.render({lead})
        elif not it.warning:
            hidden.add(it.host, len(it.texts))
        elif it.key not in shown and lead not in hosts_of[it.key]:
            shown.add(it.key)
            out += grouped(it)
    return out


@dataclass
class _Held:
    item: _Item
    hosts: set[int]
    deadline: float
    stamps: tuple[str | None, ...] | None = None  # the earliest host's times, once another joined


class QuietStream:
    """The quiet view of lines as they arrive (see the module doc).

    `feed(line, now)` takes one line and returns what to print now; `due(now)` returns the held
    warnings whose window has passed; `flush()` returns everything still held (call it at the
    end of the stream). `hosts`: how many hosts the job has, so a warning every host said goes
    out before its window ends (None: only the window). Times are seconds on any monotonic clock.
    """

    def __init__(self, hosts: int | None = None, window: float = WINDOW_S, lead: int = LEAD):
        self.hosts = hosts
        self.window = window
        self.lead = lead
        self.hidden = Hidden()
        self._split = _Splitter()
        self._held: list[_Held] = []  # in order of arrival
        self._open: dict[Key, list[_Held]] = {}  # held entries of each key, oldest first
        self._shown: set[Key] = set()  # keys already printed

    def feed(self, line: str, now: float) -> list[str]:
        out = self.due(now)
        stamp, rest = split_stamp(line)
        host, text = split_host(rest)
        if host is None:
            out.append(line)
            return out
        for it in self._split.feed(host, text, now, stamp):
            out += self._take(it, now)
        return out

    def due(self, now: float) -> list[str]:
        out: list[str] = []
        for it in self._split.close_stale(now - self.window):
            out += self._take(it, now)
        while self._held and self._held[0].deadline <= now:
            out += self._emit(self._held[0])
        return out

    def flush(self) -> list[str]:
        out: list[str] = []
        for it in self._split.close_all():
            out += self._take(it, 0.0)
        while self._held:
            out += self._emit(self._held[0])
        return out

    def _take(self, it: _Item, now: float) -> list[str]:
        if it.chatter:
            self.hidden.notices += len(it.texts)
            return []
        if not it.warning:
            if it.host == self.lead:
                return it.render({it.host})
            self.hidden.add(it.host, len(it.texts))
            return []
        # The k-th time a host says a line joins the oldest held entry this host has not joined.
        opened = self._open.setdefault(it.key, [])
        held = next((h for h in opened if it.host not in h.hosts), None)
        if held is not None:
            held.hosts.add(it.host)
            held.stamps = _earliest([held.stamps or held.item.stamps, it.stamps])
            if self.hosts is not None and len(held.hosts) >= self.hosts:
                return self._emit(held)  # every host said it: no need to wait
            return []
        if it.host != self.lead and (opened or it.key in self._shown):
            return []  # another host's repeat of a line it said: that line is shown once
        # A new line, or the lead said it again (all the lead's lines are shown).
        held = _Held(it, {it.host}, now + self.window)
        self._held.append(held)
        opened.append(held)
        if self.hosts is not None and self.hosts <= 1:
            return self._emit(held)
        return []

    def _emit(self, held: _Held) -> list[str]:
        self._held.remove(held)
        opened = self._open[held.item.key]
        opened.remove(held)
        if not opened:
            del self._open[held.item.key]
        self._shown.add(held.item.key)
        return held.item.render(held.hosts, held.stamps)


END = object()


def read_in_background(lines: Iterable[str], name: str) -> queue.Queue[object]:
    """`lines` (which may block between lines) read by a daemon thread into a queue: each line,
    then END; an exception of `lines` is put there for the reader to raise."""
    q: queue.Queue[object] = queue.Queue()

    def read() -> None:
        try:
            for line in lines:
                q.put(line)
        except BaseException as e:  # handed to the reader, raised there
            q.put(e)
        q.put(END)

    threading.Thread(target=read, name=name, daemon=True).start()
    return q


def follow_quiet(
    lines: Iterable[str],
    stream: QuietStream,
    *,
    tick: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[str]:
    """`stream`'s view of `lines`, an iterator that may block between lines (a backend's
    `logs(follow=True)`): it is read in a daemon thread, so held warnings come out when their
    window ends (checked every `tick` seconds) even while no line arrives, and all that is
    still held comes out when `lines` ends. An error of `lines` is raised here."""
    q = read_in_background(lines, "quiet-logs")
    while True:
        try:
            got = q.get(timeout=tick)
        except queue.Empty:
            yield from stream.due(clock())
            continue
        if got is END:
            break
        if isinstance(got, BaseException):
            yield from stream.flush()
            raise got
        yield from stream.feed(str(got), clock())
    yield from stream.flush()
