"""RL rollouts: prepare rollout JSONL, one rollout per row, and clipped_pg end to end."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jobspec.errors import ConfigError, DataError
from jobspec.files.run_toml import parse_run_config
from jobspec.run_config import MeshConfig
from runtime.commands.offline import eval_checkpoint, restore_checkpoint
from runtime.data.loader import OBJECTIVE_FIELDS, TokenBatches, check_objective
from runtime.data.manifest import load_manifest
from runtime.data.prepare.build import prepare_dataset
from runtime.model.build import build_model
from runtime.model.sharding import build_mesh
from runtime.train.loop import train
from runtime.train.loss import token_logprobs
from runtime.train.step import PG_BATCH_KEYS

from runs import read_jsonl, run_cli, stderr_lines, tiny_config, write_config

PG_FIELDS = ("loss_mask", "advantages", "old_logprobs")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _synthetic(n: int, seed: int = 0) -> list[dict]:
    """n PG rollouts of varied prompt and completion lengths, ids under the byte vocab."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        lp, lc = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        row = {
            "prompt_ids": rng.integers(0, 256, lp).tolist(),
            "completion_ids": rng.integers(0, 256, lc).tolist(),
            "old_logprobs": (-rng.random(lc) * 3).round(4).tolist(),
            "reward": 1.0,  # other keys are ignored
        }
        if i % 2:
            row["advantage"] = round(float(rng.normal()), 4)
        else:
            row["advantages"] = rng.normal(size=lc).round(4).tolist()
        rows.append(row)
    return rows


def _expected(row: dict, tok_encode=None) -> dict[str, np.ndarray]:
    p = np.asarray(row["prompt_ids"])
    c = np.asarray(row["completion_ids"])
    adv = np.asarray(row.get("advantages", [row.get("advantage", 0.0)] * len(c)), np.float32)
    return {
        "tokens": np.concatenate([p, c]),
        "loss_mask": np.concatenate([np.zeros(len(p)), np.ones(len(c))]).astype(np.float32),
        "advantages": np.concatenate([np.zeros(len(p), np.float32), adv]),
        "old_logprobs": np.concatenate(
            [np.zeros(len(p), np.float32), np.asarray(row["old_logprobs"], np.float32)]
        ),
    }


def test_objective_fields_match_the_train_step():
    assert OBJECTIVE_FIELDS["clipped_pg"] == PG_BATCH_KEYS
    assert OBJECTIVE_FIELDS["cross_entropy"] == ()


# --- prepare -----------------------------------------------------------------------------------


def test_prepare_rollouts_writes_aligned_fields(tmp_path):
    rows = _synthetic(30)
    src = _write_jsonl(tmp_path / "r.jsonl", rows)
    # Tiny shards: rollouts and their fields span shard boundaries.
    m = prepare_dataset([str(src)], "byte", str(tmp_path / "d"), val_fraction=0.2,
                        shard_tokens=7, format="rollouts")  # fmt: skip
    assert m.layout == "rollouts" and m.field_names == PG_FIELDS
    assert m.total_documents == 30
    train = m.split("train")
    assert len(train.shards) > 3
    for info in train.fields.values():
        assert [s.tokens for s in info.shards] == [s.tokens for s in train.shards]
    res = run_cli("data", "check", "--deep", "--json", str(tmp_path / "d/manifest.json"))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["layout"] == "rollouts" and report["fields"] == list(PG_FIELDS)

    # Every training rollout reads back exactly: one per row, targets' values aligned.
    loaded = load_manifest(str(tmp_path / "d/manifest.json"))
    n_train = train.documents
    train_rows = [r for i, r in enumerate(rows) if i % 5 != 1]
    assert len(train_rows) == n_train
    tb = TokenBatches(loaded, "train", 12, n_train, order="sequential", prefetch=0,
                      fields=("advantages", "old_logprobs"))  # fmt: skip
    batch = tb.read_step(0)
    for r, row in enumerate(train_rows):
        want = _expected(row)
        n = len(want["tokens"]) - 1
        assert np.array_equal(batch["inputs"][0, r, :n], want["tokens"][:-1])
        assert np.array_equal(batch["targets"][0, r, :n], want["tokens"][1:])
        for f in PG_FIELDS:
            assert np.array_equal(batch[f][0, r, :n], want[f][1:]), (r, f)
        assert np.all(batch["segment_ids"][0, r, :n] == 1)
        assert np.array_equal(batch["positions"][0, r, :n], np.arange(n))
        # Padding: segment 0, nothing counted, zero values.
        for k in ("segment_ids", "loss_mask", "advantages", "old_logprobs", "targets"):
            assert not np.any(batch[k][0, r, n:]), (r, k)
    assert set(batch) == {"inputs", "targets", "loss_mask", "segment_ids", "positions",
                          "advantages", "old_logprobs"}  # fmt: skip


def test_fingerprint_covers_the_fields(tmp_path):
    rows = _synthetic(6)
    a = prepare_dataset([str(_write_jsonl(tmp_path / "a.jsonl", rows))], "byte",
                        str(tmp_path / "a"), format="rollouts")  # fmt: skip
    rows[0]["old_logprobs"][0] -= 0.5  # same tokens, another old log-prob
    b = prepare_dataset([str(_write_jsonl(tmp_path / "b.jsonl", rows))], "byte",
                        str(tmp_path / "b"), format="rollouts")  # fmt: skip

    def content(m):  # each prepare writes its own shard folder: compare what the shards hold
        return [(sh.tokens, sh.sha256) for sh in m.split("train").shards]

    assert content(a) == content(b)
    assert a.fingerprint != b.fingerprint
    # A field file changed behind the manifest's back is caught by the deep check.
    path = tmp_path / "a" / a.split("train").fields["advantages"].shards[0].path
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    res = run_cli("data", "check", "--deep", str(tmp_path / "a/manifest.json"))
    assert res.returncode == 2 and "advantages shard" in res.stderr, res.stderr


def test_text_rollouts_and_supervised_kind(tmp_path):
    rows = [
        {"prompt": "Q: 2+2?\nA:", "completion": " 4"},
        {"prompt": "Q: capital of France?\nA:", "completion_ids": list(b" Paris")},
        {"prompt_ids": list(b"Say hi:"), "completion": " hi"},
    ]
    m = prepare_dataset([str(_write_jsonl(tmp_path / "s.jsonl", rows))], "byte",
                        str(tmp_path / "s"), val_fraction=0, format="rollouts")  # fmt: skip
    assert m.field_names == ("loss_mask",)  # supervised: no advantages, no old log-probs
    tb = TokenBatches(m, "train", 32, 3, order="sequential", prefetch=0)
    b = tb.read_step(0)
    for r, row in enumerate(rows):
        prompt = (row.get("prompt") or bytes(row["prompt_ids"]).decode()).encode()
        completion = (row.get("completion") or bytes(row["completion_ids"]).decode()).encode()
        n = len(prompt) + len(completion) - 1
        assert bytes(b["inputs"][0, r, :n].astype(np.uint8)) == (prompt + completion)[:-1]
        counted = b["targets"][0, r][b["loss_mask"][0, r] > 0]
        assert bytes(counted.astype(np.uint8)) == completion  # only the completion is trained
    with pytest.raises(DataError, match="holds supervised rollouts"):
        check_objective(m, "clipped_pg")
    check_objective(m, "cross_entropy")


BAD_ROLLOUTS = [  # (lines, expected text in the one-line error)
    (['{"prompt_ids": [1], "completion_ids": [2]'], "line 1 of"),
    (["[1, 2]"], "is not a JSON object"),
    (['{"prompt_ids": [1]}'], 'needs exactly one of "completion_ids"'),
    (['{"prompt_ids": [1], "prompt": "x", "completion_ids": [2]}'], 'exactly one of "prompt_ids"'),
    (['{"prompt_ids": [], "completion_ids": [2]}'], "has an empty prompt"),
    (['{"prompt_ids": [1], "completion_ids": [999]}'], "token id 999"),
    (['{"prompt_ids": [1], "completion_ids": ["a"]}'], "not a list of integers"),
    (['{"prompt_ids": [1], "completion_ids": [2, 3], "advantage": 1, "old_logprobs": [-1]}'],
     'has 1 "old_logprobs" for 2 completion tokens'),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantages": [1, 2], "old_logprobs": [-1]}'],
     'has 2 "advantages" for 1 completion tokens'),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": 1, "advantages": [1], '
      '"old_logprobs": [-1]}'], 'both "advantage" and "advantages"'),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": 1}'], "give both"),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": 1, "old_logprobs": [-1]}',
      '{"prompt_ids": [1], "completion_ids": [2]}'], "line 2 of"),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": 1, "old_logprobs": [0.5]}'],
     "log-probabilities"),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": NaN, "old_logprobs": [-1]}'],
     "not a finite number"),
    (['{"prompt_ids": [1], "completion_ids": [2], "advantage": 1, "old_logprobs": [-Infinity]}'],
     "non-finite value"),
]  # fmt: skip


@pytest.mark.parametrize("lines,expected", BAD_ROLLOUTS)
def test_bad_rollouts_fail_with_one_sentence(tmp_path, lines, expected):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = run_cli("data", "prepare", "--format", "rollouts", "--input", str(src),
                  "--out", str(tmp_path / "out"))  # fmt: skip
    err = stderr_lines(res.stderr)
    assert res.returncode == 2 and len(err) == 1 and "Traceback" not in res.stderr, res.stderr
    assert expected in err[0], err[0]
    assert not (tmp_path / "out/manifest.json").exists()


def test_rollout_inputs_must_be_jsonl_and_uncut(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    res = run_cli("data", "prepare", "--format", "rollouts", "--input", str(tmp_path / "a.txt"),
                  "--out", str(tmp_path / "o"))  # fmt: skip
    assert res.returncode == 2 and "is not a .jsonl file" in res.stderr
    src = _write_jsonl(tmp_path / "r.jsonl", _synthetic(3))
    res = run_cli("data", "prepare", "--format", "rollouts", "--input", str(src),
                  "--out", str(tmp_path / "o"), "--max-bytes", "100")  # fmt: skip
    assert res.returncode == 2 and "would cut a rollout" in res.stderr
    # Rollout lines given to the text format get a pointer to --format rollouts.
    res = run_cli("data", "prepare", "--input", str(src), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "--format rollouts" in res.stderr


# --- loader ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rollouts_manifest(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("rollouts")
    src = _write_jsonl(tmp / "r.jsonl", _synthetic(40, seed=1))
    prepare_dataset([str(src)], "byte", str(tmp / "d"), val_fraction=0.1, format="rollouts")
    return str(tmp / "d/manifest.json")


def test_shuffle_visits_every_rollout_once_per_epoch(rollouts_manifest):
    m = load_manifest(rollouts_manifest)
    tb = TokenBatches(m, "train", 12, 4, order="shuffle", seed=3, prefetch=0)
    n = tb.records_per_epoch
    assert n == m.split("train").documents
    ids = np.concatenate([tb.record_ids(s) for s in range(2 * n // 4 + 1)])
    assert sorted(ids[:n].tolist()) == list(range(n))
    assert sorted(ids[n : 2 * n].tolist()) == list(range(n))
    assert ids[:n].tolist() != ids[n : 2 * n].tolist()  # each epoch has its own order


@pytest.mark.parametrize("processes", [2, 4])
def test_rows_do_not_depend_on_the_process_count(rollouts_manifest, processes):
    m = load_manifest(rollouts_manifest)
    kw = {"order": "shuffle", "seed": 5, "prefetch": 0, "fields": ("advantages", "old_logprobs")}
    one = TokenBatches(m, "train", 12, 4, accum=2, **kw)
    parts = [TokenBatches(m, "train", 12, 4, accum=2, process_index=p, process_count=processes,
                          **kw) for p in range(processes)]  # fmt: skip
    for step in (0, 3, 7):
        whole = one.read_step(step)
        local = [p.read_step(step) for p in parts]
        for k, v in whole.items():
            assert np.array_equal(np.concatenate([lb[k] for lb in local], axis=1), v), (step, k)


def test_loader_refusals(rollouts_manifest, prepared):
    m = load_manifest(rollouts_manifest)
    with pytest.raises(ConfigError, match="would cut rollouts apart"):
        TokenBatches(m, "train", 12, 4, order="document_buffer")
    longest = m.split("train").max_document_tokens
    with pytest.raises(DataError, match=f"raise training.seq_len to at least {longest - 1}"):
        TokenBatches(m, "train", longest - 2, 4)
    TokenBatches(m, "train", longest - 1, 4)  # exactly fits
    with pytest.raises(DataError, match="per-token fields"):
        TokenBatches(load_manifest(prepared), "train", 8, 4, fields=("advantages",))


# --- clipped_pg end to end ---------------------------------------------------------------------

PROMPTS = [b"Q: pick a colour\nA:", b"Q: pick a number\nA:", b"Q: pick a fruit\nA:"]
GOOD = [b" blue", b" seven", b" apple"]
BAD = [b" qzx", b" vvkp", b" jjjj"]


def _pg_cfg(manifest: str, out: str, run_id: str = "pg", **over) -> dict:
    base = {
        "data": {"order": "shuffle"},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0, "schedule": {"kind": "constant",
                                                                     "warmup_steps": 0}},
        "training": {"objective": "clipped_pg", "seq_len": 32, "global_batch_size": 4,
                     "target_tokens": 32 * 4 * 24, "eval_every": 12},
        "evals": [{"name": "completions", "split": "train", "batches": 2}],
    }  # fmt: skip
    from jobspec.files.run_toml import merge

    return tiny_config(manifest, out, run_id=run_id, **merge(base, over))


def _completion_logprobs(model, rows: list[tuple[bytes, bytes]]) -> list[np.ndarray]:
    """log p(completion token) under `model`, per rollout (what a sampler would report): every
    rollout in one compiled forward, each padded at its end (attention is causal, so what
    follows a rollout does not change its log-probs)."""
    seqs = [
        np.frombuffer(prompt + completion, np.uint8).astype(np.int32) for prompt, completion in rows
    ]
    ids = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    lp = np.asarray(_next_token_logprobs(model, ids))
    return [row[len(p) - 1 : len(s) - 1] for row, (p, _), s in zip(lp, rows, seqs, strict=True)]


@nnx.jit
def _next_token_logprobs(model, ids: jax.Array) -> jax.Array:
    """log p(ids[:, t + 1]) given ids[:, : t + 1], for every row and position t."""
    rows, length = ids.shape[0], ids.shape[1] - 1
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    return token_logprobs(model(ids[:, :-1], positions), ids[:, 1:])


def _initial_model(cfg_dict: dict):
    cfg = parse_run_config(cfg_dict)
    parts = build_model(cfg.model, cfg.run.seed, build_mesh(MeshConfig(), jax.devices()[:1]))
    return nnx.merge(parts.graphdef, parts.params, *parts.others)


def _final_model(run_dir: Path):
    _, _, _, parts, _ = restore_checkpoint(str(run_dir), "latest")
    return nnx.merge(parts.graphdef, parts.params, *parts.others)


@pytest.fixture(scope="module")
def pg_data(tmp_path_factory):
    """GRPO-style groups: per prompt a good (+1) and a bad (-1) completion, with old log-probs
    from the very model a run with seed 0 starts from (so the first step's ratios are 1)."""
    tmp = tmp_path_factory.mktemp("pg")
    pairs = [(p, c) for p, g, b in zip(PROMPTS, GOOD, BAD, strict=True) for c in (g, b)]
    model = _initial_model(_pg_cfg(str(tmp / "unused.json"), str(tmp)))
    old = _completion_logprobs(model, pairs)
    rows = [
        {"prompt_ids": list(p), "completion_ids": list(c), "advantage": 1.0 if i % 2 == 0 else -1.0,
         "old_logprobs": lp.astype(float).tolist()}
        for i, ((p, c), lp) in enumerate(zip(pairs, old, strict=True))
    ]  # fmt: skip
    src = _write_jsonl(tmp / "rollouts.jsonl", rows * 2)  # 12 rollouts: 3 steps an epoch
    prepare_dataset([str(src)], "byte", str(tmp / "d"), val_fraction=0, format="rollouts")
    return {"manifest": str(tmp / "d/manifest.json"), "rows": rows * 2, "pairs": pairs,
            "old": old, "tmp": tmp}  # fmt: skip


def _run(cfg_dict: dict, **kw):
    return train(parse_run_config(cfg_dict), "# test\n", emit=lambda _l: None, **kw)


def test_clipped_pg_trains_from_rollouts(pg_data, tmp_path):
    cfg = _pg_cfg(pg_data["manifest"], str(tmp_path))
    r = _run(cfg, resume=False)
    assert r.status == "completed" and r.summary["steps"] == 24
    rows = read_jsonl(tmp_path / "pg/metrics/train.jsonl")
    assert len(rows) == 24

    # Step 1: the policy is the sampler, so every ratio is 1: nothing is clipped and the loss is
    # minus the mean advantage of the step's counted tokens (alignment and padding are right).
    first = rows[0]
    data = pg_data["rows"]
    ids = first["record_ids"]
    adv = np.concatenate(
        [np.full(len(data[i]["completion_ids"]), data[i]["advantage"]) for i in ids]
    )
    assert first["token_count"] == len(adv)
    assert first["pg_clip_fraction"] == 0.0
    assert first["loss"] == pytest.approx(-adv.mean(), abs=1e-5)
    assert max(r["pg_clip_fraction"] for r in rows) > 0  # later steps leave the trust region

    # The policy moved toward the good completions and away from the bad ones.
    final = _completion_logprobs(_final_model(tmp_path / "pg"), pg_data["pairs"])
    change = [float(np.sum(f - o)) for f, o in zip(final, pg_data["old"], strict=True)]
    good, bad = change[0::2], change[1::2]
    assert min(good) > 0.05 and max(bad) < -0.05, change
    # The eval is the completions' cross-entropy (prompt tokens are not counted).
    evals = read_jsonl(tmp_path / "pg/metrics/eval.jsonl")
    assert [e["step"] for e in evals] == [12, 24]
    completion_tokens = sum(len(r["completion_ids"]) for r in data)  # 2 batches of 4 = 8 rows
    assert all(0 < e["token_count"] <= completion_tokens for e in evals)
    # Offline eval of the final checkpoint reproduces the run's own final eval.
    offline = eval_checkpoint(str(tmp_path / "pg"), "latest")["results"][0]
    assert offline["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-6)


def test_clipped_pg_resume_is_exact(pg_data, tmp_path):
    whole = _pg_cfg(pg_data["manifest"], str(tmp_path), run_id="whole",
                    training={"target_tokens": 32 * 4 * 8})  # fmt: skip
    _run(whole, resume=False)
    split = _pg_cfg(pg_data["manifest"], str(tmp_path), run_id="split",
                    training={"target_tokens": 32 * 4 * 8})  # fmt: skip
    assert _run(split, resume=False, max_steps=5).status == "stopped"
    assert _run(split, resume=True).status == "completed"
    a = read_jsonl(tmp_path / "whole/metrics/train.jsonl")
    b = read_jsonl(tmp_path / "split/metrics/train.jsonl")
    keys = ("loss", "token_count", "pg_clip_fraction", "batch_hash", "grad_norm")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def test_runtime_local_clipped_pg_cli(pg_data, tmp_path):
    """As a user runs it: prepared on first use from [data.prepare], accumulation on."""
    out = tmp_path / "fresh"
    cfg = _pg_cfg(str(out / "manifest.json"), str(tmp_path / "runs"), run_id="cli",
                  data={"prepare": {"inputs": [str(pg_data["tmp"] / "rollouts.jsonl")],
                                    "format": "rollouts", "val_fraction": 0}},
                  training={"global_batch_size": 2, "gradient_accumulation_steps": 2,
                            "target_tokens": 32 * 4 * 3},
                  evals=[])  # fmt: skip
    path = write_config(tmp_path / "pg.toml", cfg)
    res = run_cli("local", str(path))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_jsonl(tmp_path / "runs/cli/metrics/train.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["pg_clip_fraction"] == 0.0
    live = [ln for ln in res.stdout.splitlines() if ln.startswith("step: 1 |")]
    assert len(live) == 1 and live[0].endswith("| clipped: 0.0%"), res.stdout
    diag = json.loads((tmp_path / "runs/cli/diagnostics/runtime.json").read_text())
    assert diag["data"]["pipeline"]["layout"] == "rollouts"
    # A rollout longer than seq_len is refused before training, naming the fix.
    short = write_config(tmp_path / "short.toml", {**cfg, "run": {**cfg["run"], "id": "short"},
                                                   "training": {**cfg["training"], "seq_len": 8}})  # fmt: skip
    res = run_cli("local", str(short))
    assert res.returncode == 2 and "raise training.seq_len to at least" in res.stderr, res.stderr
    assert not (tmp_path / "runs/short/checkpoints").exists()


def test_clipped_pg_on_two_hosts_matches_one(pg_data, tmp_path):
    """Each host reads only its rows of each rollout batch; the losses are the one-host run's."""
    from multihost import run_hosts

    def config(name: str, mesh: dict) -> dict:
        return _pg_cfg(pg_data["manifest"], str(tmp_path / name), run_id="mh", mesh=mesh,
                       training={"target_tokens": 32 * 4 * 6}, evals=[],
                       runtime={"host_loss_timeout_s": 20, "boot_timeout_s": 60})  # fmt: skip

    # The one-host run in this process: what `runtime worker` trains on one host, without
    # another process to start.
    assert _run(config("p1", {}), resume=False).status == "completed"
    path = write_config(tmp_path / "p2.toml", config("p2", {"fsdp": 2}))
    env = {"JAXJOB_RUN_ID": "mh", "JAXJOB_ATTEMPT": "0"}
    for r in run_hosts(["worker", str(path)], 2, 1, env=env, timeout=300):
        assert r.returncode == 0, f"host {r.process_id}: {r.output[-3000:]}"
    one = read_jsonl(tmp_path / "p1/mh/metrics/train.jsonl")
    two = read_jsonl(tmp_path / "p2/mh/metrics/train.jsonl")
    assert [r["batch_hash"] for r in one] == [r["batch_hash"] for r in two]
    for a, b in zip(one, two, strict=True):
        assert a["token_count"] == b["token_count"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["pg_clip_fraction"] == pytest.approx(b["pg_clip_fraction"], abs=1e-6)
