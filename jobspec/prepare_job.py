"""A prepare job: the `prepare:` section of job.yaml, and the config its hosts read (cfg.toml).

A job.yaml with `prepare:` instead of `run:` tokenizes its inputs on all of its hosts at once:
host i of n writes the parts p with p % n == i, and host 0 writes the manifest once every part
is there (docs/data.md, "Preparing on many hosts"). Its hosts read a small TOML, `[run]` (id,
output_uri: where the run's own records and host logs go) and `[prepare]`; `runtime worker`
tells it from a training run config by its top-level `[prepare]` table. Nothing here imports jax.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import tomli_w
from pydantic import Field, ValidationError, field_validator

from jobspec.errors import ConfigError
from jobspec.files.run_toml import describe_validation_error, merge, read_toml
from jobspec.run_config import RunSection, RuntimeConfig, is_remote
from jobspec.section import Section

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_NOT_A_SIZE = "not a size; write it like 128M, 512K or 1G, or as a number of bytes"


def size_bytes(value: int | str) -> int:
    """Bytes of a size written as a byte count or like 128M, 512K, 1G (K/M/G are 2^10/20/30,
    as `runtime data prepare --part-size` reads them); ValueError when it is none."""
    if isinstance(value, bool):  # YAML `yes` is no size
        raise ValueError(_NOT_A_SIZE)
    if isinstance(value, int):
        n = value
    else:
        text = value.strip().upper().removesuffix("B").removesuffix("I")
        try:
            n = int(float(text[:-1]) * _UNITS[text[-1]]) if text[-1:] in _UNITS else int(text)
        except ValueError:
            n = 0
    if n <= 0:
        raise ValueError(_NOT_A_SIZE)
    return n


def local_relative(path: str) -> bool:
    """Neither a URI, nor an absolute path, nor a '{stdlib}' glob."""
    return not (is_remote(path) or path.startswith(("file://", "{")) or os.path.isabs(path))


class PrepareSection(Section):
    """job.yaml `prepare:` (and the hosts' `[prepare]`): what every host of the job prepares."""

    inputs: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description=(
            "Globs (local or gs://) of *.parquet, *.jsonl[.gz|.zst] or text files (any other file "
            "is one document); a relative path is relative to the job.yaml's folder."
        ),
    )
    tokenizer: str = Field(
        "byte", min_length=1, description="'byte' or a path or URI of a tokenizer.json."
    )
    out: str = Field(
        min_length=1,
        description=(
            "Folder (local or gs://) of the dataset; every host writes its parts there, so it is "
            "storage all hosts share. Relative to the job.yaml's folder when relative."
        ),
    )
    text_field: str = Field(
        "text", min_length=1, description="The JSONL key or parquet column holding the text."
    )
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.05, description="Share of documents held out as the validation split."
    )
    workers: Annotated[int, Field(gt=0)] | None = Field(
        None, description="Processes tokenizing at once on each host (default: the host's cores)."
    )
    part_size: int | str = Field(
        "128M",
        description=(
            "Input bytes per part (128M, 512K, 1G or a byte count): the unit of work a host "
            "takes, and part of the dataset's identity."
        ),
    )
    format: Literal["text", "rollouts"] = Field(
        "text",
        description=(
            "text: documents packed into a token stream; rollouts: JSONL rollouts, one per row "
            "(their inputs are one part, so one host does the work)."
        ),
    )

    @field_validator("part_size", mode="before")
    @classmethod
    def _part_size(cls, v: object) -> object:
        if not isinstance(v, int | str):
            raise ValueError(_NOT_A_SIZE)
        size_bytes(v)  # the error names the field, and the value after the sentence
        return v

    @property
    def part_bytes(self) -> int:
        return size_bytes(self.part_size)

    def resolved(self, base: Path) -> PrepareSection:
        """The section with relative local paths made absolute against `base` (the job.yaml's
        folder), so every host, whatever its working directory, reads the same files."""

        def fix(path: str) -> str:
            return os.path.abspath(os.path.join(base, path)) if local_relative(path) else path

        tok = self.tokenizer if self.tokenizer == "byte" else fix(self.tokenizer)
        return self.model_copy(
            update={"inputs": [fix(i) for i in self.inputs], "tokenizer": tok, "out": fix(self.out)}
        )


class PrepareJobConfig(Section):
    """The cfg.toml of a prepare job's hosts."""

    run: RunSection
    prepare: PrepareSection
    runtime: RuntimeConfig = RuntimeConfig()


def prepare_toml(section: PrepareSection, run_id: str, output_uri: str | None) -> dict:
    """The hosts' config as a TOML table: `[run]` id (and output_uri when the spec sets it) and
    every `[prepare]` key written out, so the file says exactly what the hosts do."""
    run: dict = {"id": run_id}
    if output_uri is not None:
        run["output_uri"] = output_uri
    return {"run": run, "prepare": section.model_dump(mode="json", exclude_none=True)}


def parse_prepare_config(data: dict, source: str) -> PrepareJobConfig:
    try:
        return PrepareJobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, PrepareJobConfig, source)) from None


def is_prepare_config(path: str | Path) -> bool:
    """Whether the hosts' config at `path` is a prepare job's (a top-level [prepare] table); a
    training run config keeps its prepare settings under [data.prepare]."""
    return isinstance(read_toml(path).get("prepare"), dict)


def load_prepare_config(
    path: str | Path, overrides: dict | None = None
) -> tuple[PrepareJobConfig, str]:
    """(validated config, its TOML as the hosts run it, overrides merged in)."""
    data = read_toml(path)
    if overrides:
        data = merge(data, overrides)
    return parse_prepare_config(data, str(path)), tomli_w.dumps(data)
