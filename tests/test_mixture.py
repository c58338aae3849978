"""Weighted mixtures of prepared datasets (`[[data.sources]]`): config, order, rows, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import ConfigError, DataError
from jobspec.files.run_toml import merge, parse_run_config
from jobspec.run_config import MIXTURE_BLOCK
from runtime.commands.cli import main
from runtime.data.loader import TokenBatches
from runtime.data.manifest import load_manifest
from runtime.data.mixture import Mixture, block_counts, open_data
from runtime.data.prepare.build import prepare_dataset

from runs import read_jsonl, stderr_lines, tiny_config, write_config

KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")
LETTERS = {"web": "w", "code": "c", "math": "m"}  # every document of a source is its letter


def _prepare(root: Path, name: str, tokenizer: str = "byte", docs: int = 8) -> str:
    src = root / f"{name}-in"  # beside the dataset folder: prepare keeps to a folder of its own
    src.mkdir(parents=True)
    letter = LETTERS.get(name, "x")
    for i in range(docs):
        (src / f"{i}.txt").write_text(f"{letter * (30 + 11 * i)}\n")
    prepare_dataset([f"{src}/*.txt"], tokenizer, str(root / name), val_fraction=0.25)
    return str(root / name / "manifest.json")


def _bpe_tokenizer(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["xxxx yyyy\n", "web code math\n"] * 10, trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    out = {name: _prepare(root, name) for name in LETTERS}
    out["bpe"] = _prepare(root, "bpe", _bpe_tokenizer(root / "tokenizer.json"))
    rollouts = root / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"prompt": "Q: 2+2?\nA:", "completion": " 4"}) + "\n")
    prepare_dataset([str(rollouts)], "byte", str(root / "rl"), val_fraction=0, format="rollouts")
    out["rl"] = str(root / "rl/manifest.json")
    return out


def _mixture(data, weights: dict[str, float]) -> Mixture:
    names = list(weights)
    return Mixture(names, [load_manifest(data[n]) for n in names], list(weights.values()))


def _sources(data, weights: dict[str, float]) -> list[dict]:
    return [{"manifest": data[n], "weight": w} for n, w in weights.items()]


# --- config ------------------------------------------------------------------------------------


def test_config_takes_a_manifest_or_sources(data):
    def cfg(**d):
        return parse_run_config(tiny_config("unused", "/tmp/unused", data=d))

    one = cfg()  # tiny_config's data.manifest, as before
    assert one.data.sources is None and [d.share for d in one.data.datasets] == [1.0]
    mixed = cfg(manifest=None, sources=_sources(data, {"web": 3, "code": 1}))
    # Names default to the manifest's folder; weights are normalised.
    assert [(d.name, d.share) for d in mixed.data.datasets] == [("web", 0.75), ("code", 0.25)]
    refused = {
        "both": (dict(sources=_sources(data, {"web": 1})), "set exactly one of data.manifest"),
        "neither": (dict(manifest=None), "this config sets neither"),
        "prepare": (
            dict(manifest=None, sources=_sources(data, {"web": 1}), prepare={"inputs": ["x"]}),
            "data.prepare makes one manifest and does not combine with [[data.sources]]",
        ),
        "same name": (
            dict(manifest=None, sources=_sources(data, {"web": 1}) * 2),
            "data.sources names must be unique",
        ),
        "zero weight": (
            dict(manifest=None, sources=_sources(data, {"web": 0})),
            "data.sources[0].weight",
        ),
        "tiny share": (
            dict(manifest=None, sources=_sources(data, {"web": 1, "code": 1e-4})),
            "data.sources[1].weight (0.0001)",
        ),
    }
    for case, (d, phrase) in refused.items():
        with pytest.raises(ConfigError) as e:
            cfg(**d)
        assert phrase in str(e.value), (case, str(e.value))


# --- order -------------------------------------------------------------------------------------


def test_each_block_holds_the_weights_exactly_and_proportions_match(data):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2 + 1e-4}
    mix = _mixture(data, weights)
    shares = np.array(mix.shares)
    # Largest-remainder rounding: floors first, then the biggest remainders; a full block.
    assert block_counts([0.7, 0.3], 4096).tolist() == [2867, 1229]
    assert block_counts([1 / 3] * 3, 4096).tolist() == [1366, 1365, 1365]
    assert mix.counts.sum() == MIXTURE_BLOCK
    assert np.abs(mix.counts - shares * MIXTURE_BLOCK).max() < 1
    tb = TokenBatches(mix, "train", 8, 16, accum=2, order="shuffle", seed=5, prefetch=0)
    order = tb.record_order
    blocks = 3
    j, k = order.sources_and_counts(np.arange(blocks * MIXTURE_BLOCK))
    for b in range(blocks):
        per_block = np.bincount(j[b * MIXTURE_BLOCK : (b + 1) * MIXTURE_BLOCK], minlength=3)
        assert per_block.tolist() == mix.counts.tolist()
    # k_j is the count of source j's earlier samples: 0, 1, 2, … within every source.
    for src in range(3):
        assert k[j == src].tolist() == list(range(int((j == src).sum())))
    # Blocks are permuted differently, and by the seed.
    assert not np.array_equal(j[:MIXTURE_BLOCK], j[MIXTURE_BLOCK : 2 * MIXTURE_BLOCK])
    # Over steps that do not line up with blocks, each source's share is its weight within 4
    # standard errors (binomial; the blocks make the error smaller still).
    steps = range(300, 460)
    counts = np.zeros(3)
    for s in steps:
        prov = tb.provenance(s)
        assert sum(prov["tokens_per_source"].values()) == 16 * 2 * 8
        counts += [prov["tokens_per_source"][n] // 8 for n in weights]
    n = counts.sum()
    assert np.all(np.abs(counts / n - shares) <= 4 * np.sqrt(shares * (1 - shares) / n)), counts
    # A step far out needs only its own blocks: the counts come from (seed, n), no replay.
    far = order.sources_and_counts(np.arange(10**9, 10**9 + 4))
    b = 10**9 // MIXTURE_BLOCK
    assert np.all(far[1] >= b * mix.counts[far[0]])


@pytest.mark.parametrize("order", ["sequential", "shuffle", "document_buffer"])
def test_rows_come_from_their_source(data, order):
    mix = _mixture(data, {"web": 2, "code": 1})
    tb = TokenBatches(mix, "train", 8, 8, accum=2, order=order, seed=1, prefetch=0)
    seen = set()
    for step in (0, 1, 57):
        prov, batch = tb.provenance(step), tb.read_step(step)
        rows = batch["inputs"].reshape(-1, 8)
        for r, name in enumerate(prov["sources"]):
            letters = {chr(t) for t in rows[r] if t < 128 and chr(t).isalpha()}
            assert letters == {LETTERS[name]}, (name, letters)
            seen.add(name)
    assert seen == {"web", "code"}
    if order == "sequential":  # each source reads its own records in order, from 0
        prov = tb.provenance(0)
        for name in ("web", "code"):
            ids = [i for i, s in zip(prov["record_ids"], prov["sources"], strict=True) if s == name]
            assert ids == list(range(len(ids)))


@pytest.mark.parametrize("order", ["shuffle", "document_buffer"])
def test_batches_do_not_depend_on_process_count(data, order):
    mix = _mixture(data, {"web": 0.6, "code": 0.4})
    gbs, accum, T, steps = 8, 2, 8, 4

    def global_batches(P: int) -> list:
        loaders = [
            TokenBatches(mix, "train", T, gbs, accum, order, 3, p, P, prefetch=0) for p in range(P)
        ]
        out = []
        for s in range(steps):
            provs = [ld.provenance(s) for ld in loaders]
            assert all(p == provs[0] for p in provs)
            parts = [ld.read_step(s) for ld in loaders]
            out.append((provs[0], {k: np.concatenate([b[k] for b in parts], axis=1) for k in KEYS}))
        return out

    ref = global_batches(1)
    for P in (2, 4):
        for (p1, b1), (p2, b2) in zip(ref, global_batches(P), strict=True):
            assert p1 == p2
            assert all(np.array_equal(b1[k], b2[k]) for k in KEYS)


def test_iterator_state_names_the_sources(data):
    mix = _mixture(data, {"web": 0.7, "code": 0.3})
    tb = TokenBatches(mix, "train", 8, 4, accum=2, order="shuffle", seed=7, prefetch=2)
    with tb.iterate() as it:
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        expected = [next(it) for _ in range(3)]
    assert [s["weight"] for s in state["sources"]] == [0.7, 0.3]
    fresh = TokenBatches(mix, "train", 8, 4, accum=2, order="shuffle", seed=7, process_count=2,
                         process_index=1)  # fmt: skip
    with fresh.iterate() as it:
        it.set_state(state)
        got = [next(it) for _ in range(3)]
    for e, g in zip(expected, got, strict=True):
        assert e.provenance == g.provenance
        assert np.array_equal(e.batch["inputs"][:, 2:], g.batch["inputs"])
    other = TokenBatches(_mixture(data, {"web": 0.5, "code": 0.5}), "train", 8, 4, accum=2,
                         order="shuffle", seed=7)  # fmt: skip
    with other.iterate() as it, pytest.raises(DataError, match="saved data-iterator state has"):
        it.set_state(state)


def test_sources_must_share_a_tokenizer_and_be_streams(data):
    with pytest.raises(DataError) as e:
        _mixture(data, {"web": 1, "bpe": 1})
    msg = str(e.value)
    assert "data.sources[1] (bpe)" in msg and "data.sources[0] (web)" in msg
    assert "'byte'" in msg and "'hf:" in msg
    with pytest.raises(DataError, match=r"data.sources\[1\] \(rl\) is a rollouts manifest"):
        _mixture(data, {"web": 1, "rl": 1})


# --- end to end --------------------------------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    lines = stderr_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return int(exc.value.code or 0), lines[0]


def _mix_config(data, out: Path, run_id: str, weights: dict[str, float], **over) -> dict:
    cfg = tiny_config("", str(out), run_id=run_id, **over)
    cfg["data"] = {"sources": _sources(data, weights), "order": "shuffle", "prefetch": 1}
    return cfg


def test_mixed_tokenizers_are_one_sentence(data, tmp_path, capsys):
    cfg = _mix_config(data, tmp_path, "tok", {"web": 1, "bpe": 1})
    code, line = _cli(capsys, "local", str(write_config(tmp_path / "tok.toml", cfg)))
    assert code == 2 and "data.sources[1] (bpe) was prepared with tokenizer 'hf:" in line, line


@pytest.mark.slow
def test_mixture_evals_report_each_source(data, tmp_path):
    """An eval over a mixture reports each source's loss and counted tokens: their token-weighted
    mean is the mixed loss, and each is the loss of an eval over that source's rows alone."""
    from runtime.commands.offline import restore_checkpoint
    from runtime.data.loader import eval_loader
    from runtime.observe.sinks import eval_scalars
    from runtime.run.inspect import inspect_run, render
    from runtime.train.evaluate import Evaluator
    from runtime.train.loop import train

    weights = {"web": 0.6, "code": 0.4}
    over = {"training": {"target_tokens": 16 * 8 * 2}, "evals": [{"name": "val", "batches": 2}]}
    cfg = parse_run_config(_mix_config(data, tmp_path, "each", weights, **over))
    lines: list[str] = []
    assert train(cfg, "# test\n", emit=lines.append, resume=False).status == "completed"
    [row] = read_jsonl(tmp_path / "each/metrics/eval.jsonl")  # the final eval, at step 2
    per, tokens = row["loss_per_source"], row["token_count_per_source"]
    assert list(per) == list(tokens) == list(row["loss_sum_per_source"]) == list(weights)
    assert sum(tokens.values()) == row["token_count"] == 2 * 8 * 16
    assert sum(row["loss_sum_per_source"].values()) == pytest.approx(row["loss_sum"], rel=1e-6)
    mean = sum(per[n] * tokens[n] for n in weights) / sum(tokens.values())
    assert mean == pytest.approx(row["loss"], rel=1e-6)
    assert per["web"] != pytest.approx(per["code"], rel=1e-3)  # two sources, two figures

    # The eval's rows of each source (read sequentially from its record 0) evaluated alone, in
    # one batch of exactly that many rows, with the checkpoint's parameters.
    rows = [s for b in range(2) for s in eval_loader(open_data(cfg.data), "validation", 16, 8)
            .provenance(b)["sources"]]  # fmt: skip
    restored = restore_checkpoint(str(tmp_path / "each"), "latest")
    assert restored.step == 2
    for name in weights:
        alone = parse_run_config(tiny_config(data[name], str(tmp_path), run_id=f"only-{name}",
                                             training={"global_batch_size": rows.count(name)}))  # fmt: skip
        ev = Evaluator(alone, load_manifest(data[name]), restored.parts, restored.mesh)
        got = ev.evaluate(restored.parts.params, "only", "validation", 1)
        assert "loss_per_source" not in got  # one manifest: the row as before
        assert got["token_count"] == tokens[name] == rows.count(name) * 16
        assert got["loss"] == pytest.approx(per[name], rel=1e-5), name

    # The console line, the sinks' scalars, and inspect show the sources too.
    [line] = [ln for ln in lines if ln.startswith("eval val @ step 2 ")]
    assert f"loss: {row['loss']:.3f} (web {per['web']:.3f}, code {per['code']:.3f}) |" in line
    sc = eval_scalars(row)
    assert sc["eval/val/loss"] == row["loss"] and sc["eval/val/loss/code"] == per["code"]
    assert sc["eval/val/token_count/web"] == tokens["web"]
    assert not any("per_source" in k for k in sc)
    report = inspect_run(str(tmp_path / "each"))
    assert report["latest_eval"] == report["best_eval"]
    assert report["best_eval"] == {"step": 2, "name": "val", "loss": row["loss"],
                                   "loss_per_source": per}  # fmt: skip
    assert f"best eval    val {row['loss']:.4f} at step 2 (web {per['web']:.4f}, " in render(report)


@pytest.mark.slow
def test_mixture_training_resumes_exactly(data, tmp_path, capsys, monkeypatch):
    from runtime.commands.offline import eval_checkpoint, sample_checkpoint
    from runtime.commands.preflight import preflight
    from runtime.train.loop import train

    weights = {"web": 0.7, "code": 0.3}
    over = {"training": {"target_tokens": 16 * 8 * 6}, "checkpoint": {"every": 3}}
    evals = {"evals": [{"name": "val", "batches": 2}]}  # not in the resume fingerprint

    def run(run_id: str, **kw):
        extra = evals if run_id == "whole" else {}
        cfg = parse_run_config(_mix_config(data, tmp_path, run_id, weights, **over, **extra))
        return train(cfg, "# test\n", emit=lambda _line: None, **kw)

    assert run("whole", resume=False).status == "completed"
    assert run("split", resume=False, max_steps=3).status == "stopped"
    assert run("split", resume=True).status == "completed"
    whole = read_jsonl(tmp_path / "whole/metrics/train.jsonl")
    parted = read_jsonl(tmp_path / "split/metrics/train.jsonl")
    assert [r["loss"] for r in whole] == [r["loss"] for r in parted]  # bitwise on CPU
    assert [r["batch_hash"] for r in whole] == [r["batch_hash"] for r in parted]
    for r in whole:
        assert set(r["tokens_per_source"]) == set(weights)
        assert sum(r["tokens_per_source"].values()) == 16 * 8
        assert [r["sources"].count(n) * 16 for n in weights] == list(
            r["tokens_per_source"].values()
        )
    # Evals read the mixture of the sources' validation splits, the same from a checkpoint.
    final = read_jsonl(tmp_path / "whole/metrics/eval.jsonl")[-1]
    again = eval_checkpoint(str(tmp_path / "whole"), "latest")["results"][0]
    assert final["token_count"] == again["token_count"] == 2 * 8 * 16
    assert again["loss"] == pytest.approx(final["loss"], rel=1e-5)
    sample = sample_checkpoint(str(tmp_path / "whole"), "latest", [119], max_new_tokens=2,
                               temperature=1.0, top_k=1, seed=0)  # fmt: skip
    assert sample["text"] is not None  # the sources' tokenizer decodes it
    cfg = parse_run_config(_mix_config(data, tmp_path, "whole", weights, **over))
    # The data check is the point here; the compiled memory report is another test's.
    monkeypatch.setattr("runtime.commands.preflight.compiled_memory", lambda *_: None)
    checks = {c["name"]: c for c in preflight(cfg)["checks"]}
    assert checks["data"]["ok"] and "mixture of web 70%, code 30%" in checks["data"]["detail"]
    assert isinstance(open_data(cfg.data), Mixture)
    # The whole run's eval reads more web rows than that tiny validation split holds: said once.
    warned = [ln for ln in stderr_lines(capsys.readouterr().err) if ln.startswith("warning:")]
    assert len(warned) == 1 and "eval 'val' reads 12 rows of the validation split" in warned[0]

    # A changed weight, or another source, on resume: one sentence naming the field, exit 2.
    more = {"training": {"target_tokens": 16 * 8 * 9}}
    changes = {
        "weight": ({"web": 0.7, "code": 0.5}, "compatibility.data.sources[1].weight changed "
                   "(value 0.3 in the checkpoint, 0.5 in the config)"),
        "added": ({"web": 0.7, "code": 0.3, "math": 0.1}, "compatibility.data.sources changed"),
    }  # fmt: skip
    for case, (w, phrase) in changes.items():
        changed = _mix_config(data, tmp_path, "whole", w, **merge(over, more))
        code, line = _cli(
            capsys, "local", "--resume", str(write_config(tmp_path / f"{case}.toml", changed))
        )
        assert code == 2 and phrase in line and "start a new run.id" in line, line
