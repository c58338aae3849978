"""Group a step's per-op device time (bench/tpu/xplane_summary.py's JSON) into what the MoE cut's
diagnosis needs: grouped matmuls, attention, MoE permute / combine / routing, lm head and loss,
dense matmuls, optimizer, the rest; each split into forward, remat recompute and backward.

    python3 bench/tpu/op_breakdown.py NAME=PROFILE_JSON:HLO_TEXT[.gz] ... [--vocab 32000] [--json OUT]

HLO_TEXT is the same program's optimised HLO (bench/tpu/moe_profile.py --hlo, or XLA's
--xla_dump_to for MaxText): each op's `metadata={op_name=...}` (JAX's name stack) says which
code made it and whether it runs forward (`jvp`), as remat recompute (`rematted_computation`)
or backward (`transpose`). Prints one table: ms per step of each group, one column per NAME.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from typing import Any

GROUPS = (
    "grouped matmul (megablox gmm/tgmm)",
    "grouped matmul bookkeeping",
    "attention kernel (splash)",
    "MoE permute (gather/scatter/sort)",
    "MoE combine (weighted sum over k)",
    "MoE routing (router, top-k)",
    "lm head + loss + embedding",
    "dense matmuls (qkvo projections)",
    "optimizer + clipping (outside fwd/bwd)",
    "other (norms, rope, silu, casts, copies)",
)
PHASES = ("forward", "recompute", "backward", "outside", "unnamed")


def load_hlo(path: str) -> dict[str, str]:
    """Instruction name -> its HLO line."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            out[m.group(1)] = line
    return out


def op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def phase(name_stack: str) -> str:
    if not name_stack:
        return "unnamed"
    if "rematted_computation" in name_stack:
        return "recompute"
    if "transpose(" in name_stack:
        return "backward"
    if "jvp(" in name_stack:
        return "forward"
    return "outside"


def group(op: str, name_stack: str, text: str, vocab: int) -> str:
    """The GROUPS entry of one op (first rule that matches)."""
    s = name_stack
    if re.match(r"t?gmm(\.|$)", op):
        return GROUPS[0]
    if "jit(gmm)" in s or "jit(tgmm)" in s:
        return GROUPS[1]
    if "splash" in op or "flash" in op:
        return GROUPS[2]
    if s and "jvp(" not in s:
        return GROUPS[8]
    if re.search(rf"[\[,]{vocab}[\],]", text):
        return GROUPS[6]
    if re.search(r"nkd,nk->nd|weight_sum|BKE,BK", s):
        return GROUPS[4]
    if re.search(r"(^|/)(gather|scatter-add|scatter|sort)$|sort_activations|argsort|_inverse", s):
        return GROUPS[3]
    if re.match(r"(gather|scatter|sort)", op):
        return GROUPS[3]
    if re.search(r"top_k|_top_k_onehot|\.\.\.d,de->\.\.\.e|routing|gate_logits", s):
        return GROUPS[5]
    if "dot_general" in s or "convolution(" in text:
        return GROUPS[7]
    return GROUPS[9]


def breakdown(profile: dict[str, Any], hlo: dict[str, str], vocab: int) -> dict[str, Any]:
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for o in profile["ops"]:
        line = hlo.get(o["op"], "")
        s = op_name(line)
        text = o["stats"].get("long_name", "") or line
        table[group(o["op"], s, text, vocab)][phase(s)] += o["self_ms"]
    return {
        "step_ms": profile["main_module_ms_per_step"],
        "groups": {g: {p: round(v, 3) for p, v in table[g].items()} for g in GROUPS},
    }


def render(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = ["| group | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for g in GROUPS:
        cells = []
        for n in names:
            by_phase = results[n]["groups"][g]
            total = sum(by_phase.values())
            parts = "/".join(f"{by_phase.get(p, 0):.1f}" for p in PHASES[:3])
            cells.append(f"{total:.1f} ({parts})")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append(
        "| step (XLA module) | " + " | ".join(f"{results[n]['step_ms']:.1f}" for n in names) + " |"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", metavar="NAME=PROFILE_JSON:HLO_TEXT")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for case in args.cases:
        name, _, paths = case.partition("=")
        prof_path, _, hlo_path = paths.partition(":")
        with open(prof_path) as f:
            profile = json.load(f)
        results[name] = breakdown(profile, load_hlo(hlo_path), args.vocab)
    print("ms per step: total (forward/recompute/backward)")
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
