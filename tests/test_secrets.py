"""Literal credentials are refused by value as well as by name, in every rendered string field
of the job spec and the run config; ordinary values (paths, gs:// URIs, model names, commit
hashes) are not.

The fake credentials are assembled at run time so that no scanner mistakes this file for a leak.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from pydantic import ValidationError

from jobspec.errors import ConfigError
from jobspec.files.job_yaml import load_job
from jobspec.files.run_toml import describe_validation_error
from jobspec.files.secrets import entropy, find_secrets, looks_random, what_secret
from jobspec.job_spec import JobSpec

from runs import tiny_config

ROOT = Path(__file__).resolve().parents[1]
RAND = "q7Vx2LmP9sKd4TzW8bNc3RfY6hJg1Ae5"  # 32 letters and digits, well mixed

FAKES = {
    "an AWS access key id": "AKIA" + "IOSFODNN7EXAMPLE",
    "a GitHub token": "ghp_" + RAND + "abcd",
    "a Slack token": "xoxb-" + "1234567890-" + RAND[:12],
    "a Google API key": "AIza" + "SyD" + RAND,
    "a PEM private-key block": "-----BEGIN RSA " + "PRIVATE KEY-----\nMIIEow...\n",
    "a GCP service-account key": '{"type": "service_account", "private_key'
    + '_id": "'
    + RAND
    + '"}',
    "an OpenAI API key": "sk-" + "proj-" + RAND,
    "a Hugging Face token": "hf_" + RAND,
    "a JSON Web Token": "eyJ"
    + "hbGciOiJIUzI1NiJ9.eyJ"
    + "zdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
}


@pytest.mark.parametrize("what", sorted(FAKES))
def test_known_formats_are_recognised_anywhere_in_a_string(what):
    value = FAKES[what]
    assert what_secret(value) == what
    assert what_secret(f"--flag={value} more") == what  # inside an argument or a setup line


@pytest.mark.parametrize(
    "url",
    ["postgres://admin:hunter2@db.internal:5432/x", "https://u:p4ss@example.com/repo.git",
     "redis://:s3cret@cache:6379"],
)  # fmt: skip
def test_credentials_in_urls(url):
    assert what_secret(url) == "a URL with a password in it"
    assert what_secret(f"pip install --index-url {url}") == "a URL with a password in it"


def test_random_token_under_a_secret_like_name():
    assert looks_random(RAND) and entropy(RAND) > 4
    assert what_secret(RAND, "wandb_key").startswith("a random token")
    assert what_secret(RAND, "MY_SERVICE_PASSWORD").startswith("a random token")
    assert what_secret(RAND, "commit") is None  # the same string under an ordinary name


@pytest.mark.parametrize(
    "name, value",
    [
        ("output_uri", "gs://jaxjob-runs/k8s"),
        ("manifest", "gs://bucket/data/stdlib-byte/manifest.json"),
        ("path", "/home/ada/runs/2024-01-01/checkpoints/000120"),
        ("init_from", "hf:Qwen/Qwen3-1.7B"),
        ("image", "nvcr.io/example/jaxjob:0.1.0-cuda12"),
        ("commit", "08dfbdfd6827a1b2c3d4e5f60718293a4b5c6d7e"),  # a commit hash
        ("fingerprint", "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"),
        ("key", "nvidia.com/gpu"),  # a toleration's key
        ("key", "cloud.google.com/gke-nodepool"),
        ("tokenizer", "/models/tokenizer.json"),
        ("token_budget", "20480"),
        ("secret", "hf"),  # a secret reference's name
        ("NCCL_DEBUG", "WARN"),
        ("url", "https://user@example.com/repo.git"),  # user, no password
        ("url", "postgres://app:$(PGPASSWORD)@db:5432/x"),  # a reference, not a credential
        ("url", "postgres://app:${PGPASSWORD}@db:5432/x"),  # the shell expands it
        ("setup", "source /opt/venv/bin/activate && module load cuda/12.4"),
        ("model", "qwen3-30b-a3b-instruct-2507"),
        ("skip", "sk-learn"),  # too short to be an OpenAI key
        ("api_key_file", "/var/run/secrets/api-key-2024-v2.txt"),  # a path under a secret name
    ],
)
def test_ordinary_values_pass(name, value):
    assert what_secret(value, name) is None, (name, value)


def _spec(**extra) -> dict:
    return {"name": "t", "run": {}, "hosts": 1, **extra}


def _refusal(doc: dict) -> str:
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate(doc)
    return describe_validation_error(e.value, JobSpec, "job.yaml")


@pytest.mark.parametrize(
    "doc, path",
    [
        (_spec(env={"S3_READER": FAKES["an AWS access key id"]}), "env.S3_READER"),
        (_spec(env={"DATABASE_URL": "postgres://u:pw@db/x"}), "env.DATABASE_URL"),
        (_spec(env={"EXTRA": FAKES["a GitHub token"]}), "env.EXTRA"),
        (_spec(slurm={"setup": ["export HF_HUB=1", "login " + FAKES["a Hugging Face token"]]}),
         "slurm.setup[1]"),
        (_spec(k8s={"annotations": {"example.com/creds": FAKES["a JSON Web Token"]}}),
         "k8s.annotations.example.com/creds"),
        (_spec(run={"data": {"manifest": "https://u:pw@host/m.json"}}), "run.data.manifest"),
        (_spec(output_uri="s3://bucket/" + FAKES["an AWS access key id"]), "output_uri"),
    ],
)  # fmt: skip
def test_the_spec_refuses_a_literal_secret_naming_the_field_and_the_fix(doc, path):
    msg = _refusal(doc)
    assert msg.startswith(f"job.yaml: {path}: the value looks like "), msg
    assert "{secret: SECRET_NAME, key: KEY}" in msg
    assert "\n" not in msg and msg.count(". ") == 0  # one sentence
    for fake in FAKES.values():  # the refusal never repeats the secret
        assert fake not in msg
    assert "pw@" not in msg


def test_env_secret_names_still_refused_by_name_and_references_pass():
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "PGPASSWORD"):
        msg = _refusal(_spec(env={name: "anything"}))
        assert msg.startswith(f"job.yaml: env: {name} looks like a secret"), msg
        assert "{secret: SECRET_NAME, key: KEY}" in msg and "anything" not in msg
    # Names that only contain a secret word, or say where the secret lives, are ordinary.
    for name, value in (("TOKENIZERS_PARALLELISM", "false"), ("WANDB_API_KEY_FILE", "/etc/w")):
        JobSpec.model_validate(_spec(env={name: value}))
    ok = JobSpec.model_validate(_spec(env={"AWS_ACCESS_KEY_ID": {"secret": "aws", "key": "id"}}))
    assert list(find_secrets(ok.model_dump(mode="json"))) == []


def test_the_run_config_file_is_checked_too(tmp_path):
    run = tiny_config("gs://b/m.json", "gs://b/runs", mesh={"data": 1})
    (tmp_path / "cfg.toml").write_text(tomli_w.dumps(run))
    (tmp_path / "job.yaml").write_text("name: t\nrun: cfg.toml\n")
    assert load_job(tmp_path / "job.yaml").spec.name == "t"
    run["data"]["manifest"] = "https://reader:" + RAND + "@data.example.com/m.json"
    (tmp_path / "cfg.toml").write_text(tomli_w.dumps(run))
    with pytest.raises(ConfigError) as e:
        load_job(tmp_path / "job.yaml")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'cfg.toml'}: data.manifest: the value looks like a URL")
    assert RAND not in msg


def test_launch_render_exits_2_with_one_sentence(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: t\nhosts: 1\nrun: {{}}\nenv:\n  PIP_INDEX: https://u:{RAND}@pypi.x\n")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "render", str(job), "--backend", "slurm"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "env.PIP_INDEX: the value looks like a URL with a password" in r.stderr
    assert "Traceback" not in r.stderr and RAND not in r.stderr + r.stdout
