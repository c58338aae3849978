"""Run configs are bounded like job specs: a TOML file over 1 MiB is refused before it is parsed,
and tables and arrays nested more than 100 deep (however written: arrays, inline tables, dotted
keys, headers; in a file, an include, an inline `run:` or a `--set`) end in one sentence naming
the file, exit 2, never a RecursionError's traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

import jobspec.files.run_toml
from jobspec.errors import ConfigError
from jobspec.files.job_yaml import load_job
from jobspec.files.run_toml import (
    MAX_RUN_CONFIG_BYTES,
    MAX_RUN_CONFIG_DEPTH,
    load_run_config,
    parse_run_config,
    toml_loads,
)
from runtime.commands.common import overrides

from runs import ROOT, run_cli, stderr_lines, tiny_config, write_config

DEEP = 50_000  # what the report used; every form must be refused in well under a second

# A TOML document whose tables and arrays nest exactly `d` levels (the top-level table is one).
NESTED = {
    "arrays": lambda d: "a = " + "[" * (d - 1) + "1" + "]" * (d - 1) + "\n",
    "inline tables": lambda d: "a = " + "{b = " * (d - 1) + "1" + "}" * (d - 1) + "\n",
    "arrays of inline tables": lambda d: (
        "a = " + "[{b = " * ((d - 1) // 2) + "1" + "}]" * ((d - 1) // 2) + "\n"
    ),
    "dotted keys": lambda d: "a" + ".b" * (d - 1) + " = 1\n",
    "a header": lambda d: "[a" + ".b" * (d - 2) + "]\nc = 1\n",
    "an [[array]] header": lambda d: "[[a" + ".b" * (d - 3) + "]]\nc = 1\n",
}


def _depth(data: object) -> int:
    """The nesting of parsed TOML, the top-level table counting as one."""
    kids = data.values() if isinstance(data, dict) else data if isinstance(data, list) else ()
    return 1 + max((_depth(k) for k in kids if isinstance(k, dict | list)), default=0)


def _no_tomllib(monkeypatch) -> None:
    """Fail the test if tomllib is asked to read: the caps must act before it does."""

    def refuse(*_a, **_k):
        raise AssertionError("tomllib read text that a cap should have refused first")

    monkeypatch.setattr(jobspec.files.run_toml.tomllib, "loads", refuse)


@pytest.mark.parametrize("form", sorted(NESTED))
def test_the_depth_limit_is_exact_for_every_form(form: str):
    """Written at the limit, each form parses; one level more is refused with its line."""
    make = NESTED[form]
    at = "x = 1\n" + make(MAX_RUN_CONFIG_DEPTH - (form == "arrays of inline tables"))
    assert _depth(toml_loads(at, "c.toml")) <= MAX_RUN_CONFIG_DEPTH
    assert _depth(tomllib.loads(at)) >= MAX_RUN_CONFIG_DEPTH - 1
    over = "x = 1\n" + make(MAX_RUN_CONFIG_DEPTH + 2)
    with pytest.raises(ConfigError) as e:
        toml_loads(over, "c.toml")
    assert str(e.value).startswith("c.toml: line 2: tables and arrays")
    assert f"more than {MAX_RUN_CONFIG_DEPTH} levels deep" in str(e.value)


@pytest.mark.parametrize("form", sorted(NESTED))
def test_50000_deep_is_refused_before_tomllib_reads_it(tmp_path, monkeypatch, form: str):
    path = tmp_path / "deep.toml"
    path.write_text(NESTED[form](DEEP))
    _no_tomllib(monkeypatch)  # a 50,000-part dotted key took tomllib 55 s and 10 GB
    with pytest.raises(ConfigError, match=r"deep\.toml: line 1: .* levels deep"):
        load_run_config(path)


def test_brackets_dots_and_hashes_inside_strings_and_comments_do_not_count():
    deep = "[{." * 300
    text = (
        f'a = "{deep}\\"{deep}"\n'
        f"b = '{deep}'\n"
        f'c = """\n{deep}\n\\"""{deep}"""""\n'
        f"d = '''\n{deep}\n'''''\n"
        f"# {deep}\n"
        f'"{deep}" = 1\n'
        "[t]\n"
        f"e = [\"{deep}\", '{deep}'] # {deep}\n"
        "f = 1.5\n"
    )
    data = toml_loads(text, "c.toml")
    assert data["a"] == f'{deep}"{deep}' and data["t"]["f"] == 1.5


def test_nesting_the_text_check_undercounts_is_caught_on_the_tables():
    """`[[a.b.b]]` goes through the last table of each earlier [[array]]: two levels a part,
    which the text check counts as one, so the parsed tables are measured too."""
    text = "".join(f"[[a{'.b' * i}]]\n" for i in range(60))
    with pytest.raises(ConfigError, match=r"^c\.toml: a\[0\]\.b\[0\]…: tables and arrays nest"):
        toml_loads(text, "c.toml")


def test_a_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = tmp_path / "big.toml"
    path.write_text('x = "' + "a" * (3 << 20) + '"\n')
    _no_tomllib(monkeypatch)
    with pytest.raises(ConfigError) as e:
        load_run_config(path)
    assert str(e.value).startswith(
        f"{path}: the run config is 3,145,735 bytes, more than the 1,048,576 a run config may have"
    )


def test_a_file_of_exactly_1_mib_is_read(tmp_path):
    path = tmp_path / "edge.toml"
    head = tomli_w.dumps(tiny_config("m/manifest.json", "out")) + "# "
    path.write_text(head + "x" * (MAX_RUN_CONFIG_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_RUN_CONFIG_BYTES
    cfg, source = load_run_config(path)
    assert cfg.run.id == "t" and len(source) == MAX_RUN_CONFIG_BYTES


def test_an_included_file_is_held_to_the_same_caps(tmp_path):
    (tmp_path / "deep.toml").write_text(NESTED["inline tables"](DEEP))
    (tmp_path / "big.toml").write_text("# " + "x" * MAX_RUN_CONFIG_BYTES + "\n")
    for name in ("deep.toml", "big.toml"):
        main = tmp_path / f"uses-{name}"
        main.write_text(f'include = ["{name}"]\n')
        where = re.escape(str(tmp_path / name))
        with pytest.raises(ConfigError, match=rf"^{where}: (line 1|the run config is)"):
            load_run_config(main)


def test_a_job_spec_inline_run_and_its_includes_are_held_to_the_caps(tmp_path):
    (tmp_path / "deep.toml").write_text(NESTED["dotted keys"](DEEP))
    job = tmp_path / "job.yaml"
    job.write_text("name: caps\nrun:\n  include: [deep.toml]\n")
    where = re.escape(str(tmp_path / "deep.toml"))
    with pytest.raises(ConfigError, match=rf"^{where}: line 1: .* levels deep"):
        load_job(job)


def test_includes_that_add_up_past_1_mib_are_refused_for_the_hosts(tmp_path):
    """Each file is within bounds, but every host reads the merged cfg.toml whole."""
    half = MAX_RUN_CONFIG_BYTES // 2
    (tmp_path / "a.toml").write_text(f'[data]\nmanifest = "{"m" * half}"\n')
    (tmp_path / "b.toml").write_text(f'[metrics.wandb]\nproject = "{"p" * half}"\n')
    cfg = tiny_config("unused", str(tmp_path / "runs"))
    del cfg["data"]["manifest"]
    write_config(tmp_path / "run.toml", {"include": ["a.toml", "b.toml"], **cfg})
    (tmp_path / "job.yaml").write_text("name: caps\nrun: run.toml\n")
    with pytest.raises(ConfigError) as e:
        load_job(tmp_path / "job.yaml")
    assert str(e.value).startswith(f"{tmp_path / 'run.toml'}: the run config with its includes")
    assert "more than the 1,048,576 a run config may have" in str(e.value)


def test_a_set_value_nested_too_deep_is_one_sentence():
    with pytest.raises(ConfigError, match=r"^--set model\.x: tables and arrays nest more than 100"):
        overrides(("model.x=" + "[" * DEEP + "]" * DEEP,))


def test_a_set_key_nested_too_deep_names_the_key(tmp_path):
    path = write_config(tmp_path / "c.toml", tiny_config("m/manifest.json", "out"))
    sets = overrides(("model" + ".x" * DEEP + "=1",))
    with pytest.raises(ConfigError, match=r"c\.toml: model\.x\.x\.x…: tables and arrays nest"):
        load_run_config(path, sets)


def test_a_deep_table_handed_to_parse_run_config_is_refused():
    data = tiny_config("m/manifest.json", "out")
    node = data["run"]
    for _ in range(DEEP):
        node = node.setdefault("x", {})
    with pytest.raises(ConfigError, match=r"^c: run\.x\.x\.x…: tables and arrays nest more"):
        parse_run_config(data, "c")


# ---- the commands named in the report, as a user runs them ------------------------------------


def _one_sentence(r: subprocess.CompletedProcess, path: Path) -> str:
    lines = stderr_lines(r.stderr)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(path) in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def deep_toml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("caps") / "deep.toml"
    path.write_text(NESTED["arrays"](DEEP))
    return path


@pytest.mark.parametrize("command", [["config", "check"], ["local"]])
def test_runtime_commands_say_one_sentence(deep_toml, command):
    r = run_cli(*command, str(deep_toml), timeout=120)
    assert "levels deep" in _one_sentence(r, deep_toml)


def test_launch_render_says_one_sentence(deep_toml, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: caps\nrun: {deep_toml}\n")
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "render", str(job), "--backend", "local"],
        cwd=ROOT, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "levels deep" in _one_sentence(r, deep_toml)
