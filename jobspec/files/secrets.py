"""Literal credentials in a job spec or run config, recognised by value as well as by name.

Everything in job.yaml and cfg.toml is rendered verbatim somewhere (the sbatch script, the
JobSet env, the ConfigMap, the run's own config/ folder), so a credential written into either
would be readable by anyone who can read those. What counts as one:

* a value in a well-known credential format (`FORMATS`): AWS access key ids, GitHub, Slack,
  Google API, OpenAI and Hugging Face tokens, JWTs, PEM private-key blocks, a GCP
  service-account key file;
* a URL with a password in it (`scheme://user:password@host`), unless the password is a
  variable reference (`$VAR`, `${VAR}`, `$(VAR)`): the shell expands one in a setup line, and
  an env value reaches the program as written (no backend expands it), so the program does;
* a long random-looking value (`looks_random`) under a name that says secret (`SECRET_WORD`):
  key, token, secret, password, credential.

The checks stay clear of what training specs are full of: paths, gs:// URIs, model names,
commit hashes under ordinary names. Nothing here echoes a value it flags.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

# (what it is, pattern); searched anywhere in a string.
FORMATS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "a GitHub token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
    ),
    ("a Slack token", re.compile(r"\bxox[abeprs]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a PEM private-key block", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY( BLOCK)?-----")),
    ("a GCP service-account key", re.compile(r"\"private_key(?:_id)?\"\s*:")),
    ("an OpenAI API key", re.compile(r"\bsk-(?:proj-|svcacct-|ant-)?[A-Za-z0-9_-]{20,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    (
        "a JSON Web Token",
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ),
)
# scheme://user:password@host; the password must not be a variable reference.
URL_PASSWORD = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:(?P<pw>[^\s/@]+)@")
VARIABLE = re.compile(r"^(?:\$[A-Za-z_][A-Za-z0-9_]*|\$\{[^}]+\}|\$\([A-Za-z_][A-Za-z0-9_]*\))$")
# Env names whose literal value would put a credential into the spec: a secret word that ends a
# `_`-separated part (HF_TOKEN, PGPASSWORD, AWS_SECRET_ACCESS_KEY; not TOKENIZERS_PARALLELISM),
# unless the name says the value is where the secret lives (WANDB_API_KEY_FILE: a path).
SECRET_ENV_NAME = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|API_?KEY|PRIVATE_?KEY"
    r"|ACCESS_?KEY|SESSION_?KEY|AUTH_?KEY)(_|$)",
    re.I,
)
NOT_A_SECRET_SUFFIX = re.compile(r"_(FILE|PATH|DIR|URI)$", re.I)
SECRET_WORD = re.compile(r"key|token|secret|passw|passphrase|credential", re.I)
TOKEN_CHARS = re.compile(r"^[A-Za-z0-9+/=_.~-]+$")
MIN_RANDOM_LEN = 20
MIN_ENTROPY_BITS = 3.5  # per character; English words and paths sit well below, keys above


def secret_env_name(name: str) -> bool:
    """Whether an env variable of this name holds a secret when its value is literal."""
    return bool(SECRET_ENV_NAME.search(name)) and not NOT_A_SECRET_SUFFIX.search(name)


def entropy(text: str) -> float:
    """Shannon entropy of the characters of `text`, in bits per character."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n else 0.0


def looks_random(value: str) -> bool:
    """A long single token of letters and digits with high entropy: a generated key, not a
    word, a path or a name."""
    return (
        len(value) >= MIN_RANDOM_LEN
        and TOKEN_CHARS.match(value) is not None
        and any(c.isdigit() for c in value)
        and any(c.isalpha() for c in value)
        and not value.startswith(("/", "."))  # a path
        and entropy(value) >= MIN_ENTROPY_BITS
    )


def what_secret(value: str, name: str = "") -> str | None:
    """What kind of credential `value` (found under `name`) looks like, or None."""
    for what, pattern in FORMATS:
        if pattern.search(value):
            return what
    for m in URL_PASSWORD.finditer(value):
        if not VARIABLE.match(m.group("pw")):
            return "a URL with a password in it"
    if SECRET_WORD.search(name) and looks_random(value):
        return f"a random token under the secret-like name {name!r}"
    return None


def walk_strings(obj: Any, path: str = "") -> Iterator[tuple[str, str, str]]:
    """(field path, the name it is under, string) for every string in nested dicts/lists;
    a dict key is checked as a string too (a label key can carry a token as well)."""
    if isinstance(obj, str):
        yield path, path.rsplit(".", 1)[-1], obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            yield sub, str(k), str(k)
            yield from walk_strings(v, sub)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from walk_strings(v, f"{path}[{i}]")


def find_secrets(obj: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(field path, what it looks like) for every literal credential in `obj`."""
    for where, name, text in walk_strings(obj, path):
        what = what_secret(text, name)
        if what is not None:
            yield where, what


def refusal(where: str, what: str) -> str:
    """The one sentence that refuses a literal credential at field path `where`."""
    if where.startswith("env."):
        name = where.split(".", 1)[1]
        fix = (
            f"reference it instead as `{name}: {{secret: SECRET_NAME, key: KEY}}` (a Kubernetes "
            "Secret on k8s, the submitting shell's variable of that name on slurm and local)"
        )
    elif what.startswith("a URL"):
        fix = (
            "drop the password from the URL and pass it in an env entry that references a "
            "secret (`NAME: {secret: SECRET_NAME, key: KEY}`)"
        )
    else:
        fix = (
            "move it to an env entry that references a secret "
            "(`NAME: {secret: SECRET_NAME, key: KEY}`) and read it from there"
        )
    return (
        f"{where}: the value looks like {what}, and a literal secret would be written into "
        f"the rendered manifests and the run's files; {fix}"
    )
