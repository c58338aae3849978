"""The quiet view of a multi-host job's output (`launch logs`, `launch submit --wait`): host 0's
lines and the other hosts' warnings, each once with a count of the hosts that said it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobspec.errors import JaxjobError
from launch.cli import cli
from launch.quiet import (
    Hidden,
    QuietStream,
    follow_quiet,
    host_ranges,
    is_warning,
    line_key,
    marker,
    quiet_lines,
)

ROOT = Path(__file__).resolve().parents[1]

GLOG_0 = "W1206 01:02:03.123456    1234 preemption_notifier.cc:90] SIGTERM caught"
GLOG_1 = "W1206 01:02:03.987654    4321 preemption_notifier.cc:90] SIGTERM caught"

# Two hosts, host by host (as a backend yields a finished run without --follow).
TWO_HOSTS = [
    "[host 0] WARNING: All log messages before absl::InitializeLog() go to STDERR",
    "[host 0] I0000 00:00:1796514018.781412   17363 cudart_stub.cc:31] no cuda drivers",
    "[host 0] step: 1 | loss: 3.9",
    f"[host 0] {GLOG_0}",
    "[host 0] step: 2 | loss: 3.5",
    "[host 0] eval: loss 3.4",
    "[host 1] WARNING: All log messages before absl::InitializeLog() go to STDERR",
    "[host 1] I0000 00:00:1796514018.785976   17364 cudart_stub.cc:31] no cuda drivers",
    "[host 1] step: 1 | loss: 3.9",
    f"[host 1] {GLOG_1}",
    "[host 1] slow disk warning: /tmp is 99% full",
    "[host 1] step: 2 | loss: 3.5",
    "[host 1] slow disk warning: /tmp is 99% full",
    "[host 1] eval: loss 3.4",
]


# ---- what counts as a warning, and what counts as the same line ------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "WARNING: x",
        "ERROR:root:x",
        "warn: x",
        "an Exception in thread",
        "Traceback (most recent call last):",
        "FATAL x",
        "CRITICAL:x",
        "ValueError: bad",
        "UserWarning: deprecated",
        GLOG_0,
        "E1206 01:02:03.123456  1234 file.cc:12] x",
        "F1206 01:02:03.123456  1234 file.cc:12] x",
    ],
)
def test_warnings_and_errors_are_recognised(text):
    assert is_warning(text)


@pytest.mark.parametrize(
    "text",
    [
        "step: 20 | loss: 3.907 | grad_norm: 1.494",
        "eval: loss 3.4 | error_rate: 0.1",
        "I1206 01:02:03.123456  1234 client.cc:1] polled an error",  # glog I: by level only
        "[Gloo] Rank 0 is connected to 1 peer ranks",
        "",
    ],
)
def test_ordinary_lines_are_not_warnings(text):
    assert not is_warning(text)


def test_glog_time_and_thread_are_not_part_of_a_line():
    assert line_key(GLOG_0) == line_key(GLOG_1)
    assert line_key(GLOG_0) != line_key(GLOG_0.replace("cc:90", "cc:91"))
    stamped = ("2026-12-06 01:02:03,123 WARNING x", "2026-12-06T01:02:04.9Z WARNING x")
    assert line_key(stamped[0]) == line_key(stamped[1]) == "WARNING x"


def test_host_lists_compress_into_ranges():
    assert host_ranges(range(64)) == "0-63"
    assert host_ranges([1, 0]) == "0,1"
    assert host_ranges([0, 1, 2, 5, 7, 8, 9, 10]) == "0-2,5,7-10"
    assert host_ranges(range(0, 40, 2)).endswith(",...")
    assert marker(range(64)) == "[64 hosts: 0-63]"
    assert marker([3]) == "[host 3]"


# ---- a complete list (launch logs) --------------------------------------------------------


def test_complete_list_keeps_host0_and_others_warnings_once():
    hidden = Hidden()
    out = quiet_lines(TWO_HOSTS, hidden)
    assert out == [
        "[2 hosts: 0,1] WARNING: All log messages before absl::InitializeLog() go to STDERR",
        "[host 0] I0000 00:00:1796514018.781412   17363 cudart_stub.cc:31] no cuda drivers",
        "[host 0] step: 1 | loss: 3.9",
        f"[2 hosts: 0,1] {GLOG_0}",  # glog lines of both hosts merged, host 0's text kept
        "[host 0] step: 2 | loss: 3.5",
        "[host 0] eval: loss 3.4",
        "[host 1] slow disk warning: /tmp is 99% full",  # once, though host 1 said it twice
    ]
    assert (hidden.lines, hidden.hosts) == (4, {1})  # host 1's glog I, 2 step and 1 eval lines
    assert "4 ordinary line(s) of host 1" in hidden.note() and "--all-hosts" in hidden.note()


def test_complete_list_of_64_hosts_says_each_line_once():
    lines = [f"[host {h}] {t}" for h in range(64) for t in ("step: 1", "ERROR: nccl timeout")]
    assert quiet_lines(lines) == ["[host 0] step: 1", "[64 hosts: 0-63] ERROR: nccl timeout"]


def test_complete_list_merges_warnings_only_other_hosts_said():
    lines = ["[host 0] step: 1", "[host 2] ERROR: oom", "[host 1] ERROR: oom", "[host 3] ok"]
    assert quiet_lines(lines) == ["[host 0] step: 1", "[2 hosts: 1,2] ERROR: oom"]


def test_a_traceback_is_one_item_shown_whole_and_once():
    tb = [
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "    raise",
        '  File "train.py", line 9, in step',
        "    raise",
        "RuntimeError: boom",
    ]
    lines = ["[host 0] step: 1", *(f"[host 1] {t}" for t in tb), *(f"[host 2] {t}" for t in tb)]
    lines.append("[host 2] step: 1")
    assert quiet_lines(lines) == ["[host 0] step: 1", *(f"[2 hosts: 1,2] {t}" for t in tb)]


def test_lines_without_a_host_pass_through_and_host0_may_be_absent():
    assert quiet_lines(["note: x", "[host 3] a", "[host 5] a"]) == ["note: x", "[host 3] a"]


# ---- streaming (--follow, submit --wait) --------------------------------------------------


def test_stream_prints_host0_at_once_and_holds_warnings_for_the_other_hosts():
    q = QuietStream(hosts=3, window=2.0)
    assert q.feed("[host 0] step: 1", 0.0) == ["[host 0] step: 1"]
    assert q.feed("[host 0] WARNING: slow", 0.1) == []  # held: hosts 1 and 2 may say it too
    assert q.feed("[host 1] step: 1", 0.2) == []  # another host's ordinary line: hidden
    assert q.feed(f"[host 1] {GLOG_1}", 0.3) == []
    assert q.feed("[host 1] WARNING: slow", 0.4) == []
    assert q.feed("[host 0] step: 2", 0.5) == ["[host 0] step: 2"]
    # Every host said it: out at once, with the count.
    assert q.feed("[host 2] WARNING: slow", 0.6) == ["[3 hosts: 0-2] WARNING: slow"]
    assert q.feed("[host 2] WARNING: slow", 0.7) == []  # a repeat of host 2's own line
    assert q.feed(f"[host 0] {GLOG_0}", 0.8) == []  # joins host 1's glog line
    assert q.due(2.2) == []
    assert q.due(2.3) == [f"[2 hosts: 0,1] {GLOG_1}"]  # its window (from 0.3) has passed
    assert q.flush() == []
    assert (q.hidden.lines, q.hidden.hosts) == (1, {1})


def test_stream_window_expiry_with_an_injected_clock():
    q = QuietStream(hosts=4, window=2.0)
    assert q.feed("[host 1] ERROR: disk", 10.0) == []
    assert q.due(11.9) == []
    assert q.feed("[host 3] ERROR: disk", 11.95) == []
    # Due at 12.0: the next line (of any host) brings it out first.
    assert q.feed("[host 0] step: 5", 12.0) == ["[2 hosts: 1,3] ERROR: disk", "[host 0] step: 5"]
    assert q.feed("[host 2] ERROR: disk", 12.5) == []  # too late: that line was shown once
    assert q.flush() == []


def test_stream_flush_at_the_end_emits_what_is_held_in_order():
    q = QuietStream(hosts=None, window=2.0)
    for t, line in enumerate(["[host 1] warning: a", "[host 0] warning: b", "[host 2] warning: a"]):
        assert q.feed(line, float(t) / 10) == []
    assert q.feed("[host 1] Traceback (most recent call last):", 0.3) == []
    assert q.feed('[host 1]   File "x.py", line 1', 0.4) == []
    assert q.flush() == [
        "[2 hosts: 1,2] warning: a",
        "[host 0] warning: b",
        "[host 1] Traceback (most recent call last):",  # the stream ended mid-traceback
        '[host 1]   File "x.py", line 1',
    ]
    assert q.flush() == []


def test_stream_shows_every_time_host0_says_a_warning():
    q = QuietStream(hosts=2, window=2.0)
    assert q.feed("[host 0] WARNING: absl", 0.0) == []
    assert q.feed("[host 0] WARNING: absl", 0.0) == []
    assert q.feed("[host 1] WARNING: absl", 0.1) == ["[2 hosts: 0,1] WARNING: absl"]
    assert q.feed("[host 1] WARNING: absl", 0.1) == ["[2 hosts: 0,1] WARNING: absl"]


def test_follow_emits_held_lines_while_the_source_blocks():
    go_on = threading.Event()
    waited = []

    def source():
        yield "[host 1] ERROR: host 1 is slow"
        go_on.wait(60)  # a backend's follow: nothing new until the test says so
        waited.append(go_on.is_set())
        yield "[host 0] step: 1"

    out = follow_quiet(source(), QuietStream(hosts=8, window=0.05), tick=0.01)
    assert next(out) == "[host 1] ERROR: host 1 is slow"
    assert waited == []  # it came while the source was still blocked, not once it went on
    go_on.set()
    assert list(out) == ["[host 0] step: 1"]


def test_follow_flushes_at_the_end_and_raises_the_sources_error():
    def source():
        yield "[host 1] WARNING: w"
        raise JaxjobError("the run can never start")

    out = follow_quiet(source(), QuietStream(hosts=2, window=60.0), tick=0.01)
    assert next(out) == "[host 1] WARNING: w"
    with pytest.raises(JaxjobError, match="never start"):
        next(out)
    done = follow_quiet(iter(["[host 1] WARNING: w"]), QuietStream(hosts=2, window=60.0))
    assert list(done) == ["[host 1] WARNING: w"]


def test_logs_host_and_all_hosts_exclude_each_other():
    r = CliRunner().invoke(cli, ["logs", "some-run", "--host", "1", "--all-hosts"])
    assert isinstance(r.exception, JaxjobError) and "exclude" in str(r.exception)


# ---- end to end: a real 2-host local run --------------------------------------------------


GLOO = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def test_native_chatter_is_left_out_of_the_quiet_view_and_counted() -> None:
    lines = [f"[host 0] {GLOO}", "[host 0] step: 1", f"[host 1] {GLOO.replace('Rank 0', 'Rank 1')}"]
    hidden = Hidden()
    assert quiet_lines(lines, hidden) == ["[host 0] step: 1"]
    assert hidden.notices == 2 and hidden.lines == 0
    assert hidden.note() == (
        "(quiet view: 2 library notice(s) not shown; --all-hosts shows every host's lines)"
    )
    q = QuietStream(hosts=2)
    assert q.feed(f"[host 0] {GLOO}", 0.0) == []
    assert q.feed("[host 0] step: 1", 0.1) == ["[host 0] step: 1"]
    assert q.feed("[host 1] step: 1", 0.2) == []
    assert q.flush() == [] and q.hidden.notices == 1
    assert q.hidden.note() == (
        "(quiet view: 1 ordinary line(s) of host 1 and 1 library notice(s) not shown; "
        "--all-hosts shows every host's lines)"
    )


def test_a_line_that_only_mentions_gloo_is_not_chatter() -> None:
    failure = "[host 1] JaxRuntimeError: INTERNAL: Gloo all-reduce failed: Connection reset by peer"
    assert quiet_lines(["[host 0] step: 1", failure]) == ["[host 0] step: 1", failure]
