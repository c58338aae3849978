"""Rollout JSONL → per-token arrays: the input of `runtime data prepare --format rollouts`.

Public API:
    read_rollouts(files, tokenizer) -> (kind, Iterator[Rollout])   the dataset's kind ('pg' or
                                                             'sft') and its rollouts, in order
    Rollout(tokens, values)                                  int64 [L] and {field: [L] array}
    rollout_fields(kind) -> dict[str, str]                   the manifest fields of a dataset kind

One JSON object per non-empty line:
    {"prompt_ids": [int, …] | "prompt": str,            the context (at least one token)
     "completion_ids": [int, …] | "completion": str,    the sampled tokens that are trained
     "advantage": float | "advantages": [float, …],     per rollout (broadcast) or per completion token
     "old_logprobs": [float, …]}                        log p(token) under the sampling policy
Token ids are used as given (give ids when the log-probs came from a sampler, so they align
exactly); text is encoded with the prepare tokenizer and no eos is added. Every line of a dataset
has the same kind: all with advantages and old_logprobs ("pg", for training.objective =
"clipped_pg"), or none with either ("sft": cross-entropy on the completion tokens only). Other keys
(rewards, group ids, …) are ignored.

Per-token values (aligned with the tokens, see runtime/data/manifest.py): loss_mask 1 on completion tokens,
0 on the prompt; advantages and old_logprobs are the completion's values, 0 on the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import numpy as np

from jobspec.errors import DataError
from runtime.data.manifest import FIELD_DTYPES, PG_FIELDS
from runtime.data.prepare.jsonl import json_objects
from runtime.data.prepare.readers import input_kind
from runtime.data.tokenizer import Tokenizer

Kind = Literal["pg", "sft"]


class Rollout(NamedTuple):
    tokens: np.ndarray
    values: dict[str, np.ndarray]


def rollout_fields(kind: Kind) -> dict[str, str]:
    names = ("loss_mask", *PG_FIELDS) if kind == "pg" else ("loss_mask",)
    return {f: FIELD_DTYPES[f] for f in names}


class _Line:
    """One line's parse, with errors that name the line."""

    def __init__(self, uri: str, lineno: int):
        self.where = f"line {lineno} of {uri}"

    def fail(self, what: str) -> DataError:
        return DataError(f"{self.where} {what}")

    def tokens(self, doc: dict, name: str, tok: Tokenizer) -> np.ndarray:
        ids_key = f"{name}_ids"
        if (ids_key in doc) == (name in doc):
            raise self.fail(f'needs exactly one of "{ids_key}" (token ids) or "{name}" (text)')
        if name in doc:
            if not isinstance(doc[name], str):
                raise self.fail(f'has a non-string "{name}"; give text, or ids as "{ids_key}"')
            ids = tok.encode(doc[name])
        else:
            raw = doc[ids_key]
            if not isinstance(raw, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in raw
            ):
                raise self.fail(f'has a "{ids_key}" that is not a list of integers')
            ids = np.asarray(raw, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                bad = int(ids.max() if ids.max() >= tok.vocab_size else ids.min())
                raise self.fail(
                    f'has token id {bad} in "{ids_key}", outside the tokenizer\'s vocabulary of '
                    f"{tok.vocab_size}; prepare with the tokenizer the rollouts were sampled with "
                    "(--tokenizer PATH/tokenizer.json)"
                )
        if ids.size == 0:
            raise self.fail(
                f"has an empty {name}; every rollout needs at least one {name} token"
                + (
                    " (the first completion token is predicted from the prompt)"
                    if name == "prompt"
                    else ""
                )
            )
        return ids

    def floats(self, doc: dict, key: str, n: int) -> np.ndarray:
        raw = doc[key]
        if not isinstance(raw, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw
        ):
            raise self.fail(f'has a "{key}" that is not a list of numbers')
        if len(raw) != n:
            raise self.fail(
                f'has {len(raw)} "{key}" for {n} completion tokens; give one per completion token '
                "(as the sampler tokenized it: give completion_ids if the text re-tokenizes "
                "differently)"
            )
        out = np.asarray(raw, dtype=np.float64)
        if not np.all(np.isfinite(out)):
            raise self.fail(f'has a non-finite value in "{key}"')
        return out

    def advantages(self, doc: dict, n: int) -> np.ndarray:
        if "advantage" in doc and "advantages" in doc:
            raise self.fail('has both "advantage" and "advantages"; give one')
        if "advantages" in doc:
            return self.floats(doc, "advantages", n)
        a = doc["advantage"]
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a):
            raise self.fail('has an "advantage" that is not a finite number')
        return np.full(n, float(a))


def _kind_of(doc: dict) -> Kind | None:
    """'pg', 'sft', or None when the line has only one of advantages / old_logprobs."""
    has_adv = "advantage" in doc or "advantages" in doc
    has_old = "old_logprobs" in doc
    if has_adv and has_old:
        return "pg"
    if not has_adv and not has_old:
        return "sft"
    return None


def _parse(doc: Any, line: _Line, tok: Tokenizer, kind: Kind) -> Rollout:
    prompt = line.tokens(doc, "prompt", tok)
    completion = line.tokens(doc, "completion", tok)
    lp, n = len(prompt), len(completion)
    values = {"loss_mask": np.concatenate([np.zeros(lp, np.uint8), np.ones(n, np.uint8)])}
    if kind == "pg":
        adv = line.advantages(doc, n)
        old = line.floats(doc, "old_logprobs", n)
        if np.any(old > 0):
            raise line.fail(
                '"old_logprobs" has a value above 0; they are log-probabilities (log p <= 0) of the '
                "completion tokens under the sampling policy"
            )
        pad = np.zeros(lp, np.float32)
        values["advantages"] = np.concatenate([pad, adv.astype(np.float32)])
        values["old_logprobs"] = np.concatenate([pad, old.astype(np.float32)])
    return Rollout(np.concatenate([prompt, completion]), values)


def read_rollouts(files: list[str], tok: Tokenizer) -> tuple[Kind, Iterator[Rollout]]:
    """The dataset's kind (from its first line) and an iterator over every rollout in order."""
    lines = _lines(files)
    first = next(lines, None)
    if first is None:
        raise DataError(
            f"the rollout inputs {files} hold no JSON lines; write one rollout object per line"
        )
    doc, line = first
    kind = _kind_of(doc)
    if kind is None:
        raise _mixed(line)

    def rollouts() -> Iterator[Rollout]:
        yield _parse(doc, line, tok, kind)
        for d, ln in lines:
            k = _kind_of(d)
            if k is None:
                raise _mixed(ln)
            if k != kind:
                raise ln.fail(
                    f"is a {'policy-gradient' if k == 'pg' else 'supervised'} rollout but the first "
                    f"line is {'policy-gradient' if kind == 'pg' else 'supervised'}; give every line "
                    'both "advantage(s)" and "old_logprobs", or none of them'
                )
            yield _parse(d, ln, tok, kind)

    return kind, rollouts()


def _mixed(line: _Line) -> DataError:
    return line.fail(
        'has only one of "advantage(s)" and "old_logprobs"; give both (for training.objective = '
        '"clipped_pg") or neither (supervised fine-tuning on the completions)'
    )


def _lines(files: list[str]) -> Iterator[tuple[dict, _Line]]:
    for uri in files:
        if input_kind(uri) != "jsonl":
            raise DataError(
                f"rollout input {uri} is not a .jsonl file; rollouts are one JSON object per line "
                "in .jsonl files (plain, .gz or .zst)"
            )
        for lineno, doc in json_objects(uri):
            yield doc, _Line(uri, lineno)
