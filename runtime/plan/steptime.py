"""A predicted step time from the compiled program: a roofline per executed instruction.

Every instruction that runs at the top of a computation (the entry, loop bodies, called and
branch computations; a fusion is one instruction, its body is not walked) costs
max(its matmul FLOPs / peak FLOP/s, the bytes it moves / HBM bandwidth), times how often it runs
(`hlo.Module.weights`: a scanned layer stack counts every layer). What it moves is its operands
read and its result written, except that an operand a fusion only dynamic-slices is charged the
slices, and a buffer a fusion dynamic-update-slices in place is charged the update (read and
written): a scan reading one layer of a stacked array moves that layer, not the stack.

Fused kernels (splash attention, cuDNN attention) are custom calls whose FLOPs the HLO does not
show: they get the analytic attention FLOPs the caller passes (`kernel_flops`), against peak,
together with the bytes of their operands and results. Collectives cost their payload over the
chip's interconnect bandwidth (one direction), added to the compute: no overlap is assumed.

The estimate's `bound` is the largest of the three parts: compute (FLOP-limited instructions),
memory (byte-limited instructions) or communication. The chip figures (peak, HBM and
interconnect bandwidth) are the vendors' published numbers, kept in `chips.toml` beside this
file. A roofline is a lower bound by construction; real instructions rarely reach either roof,
which is why the README reports the estimate next to measured steps.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from runtime.plan import hlo

_CHIPS = Path(__file__).with_name("chips.toml")
_SKIP = hlo.VIEWS | {"parameter", "while", "call", "conditional", "async-done", "copy-done",
                      "send-done", "recv-done", "domain", "opt-barrier"}  # fmt: skip
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[^"]*)"')


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    interconnect_bytes_per_s: float  # one direction, per chip


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, float]]:
    with open(_CHIPS, "rb") as f:
        return tomllib.load(f)["chip"]


def chip(name: str, peak_flops: float | None) -> Chip | None:
    """The chip figures for a catalogue name (tpu-v5e, h100-80gb, ...), or None if unknown."""
    row = _table().get(name)
    if row is None or not peak_flops:
        return None
    return Chip(name, peak_flops, row["hbm_gb_per_s"] * 1e9, row["interconnect_gb_per_s"] * 1e9)


def _param_index(ins: hlo.Instr) -> int | None:
    """N of a fused computation's `parameter(N)`."""
    if ins.opcode != "parameter" or not ins.operands:
        return None
    try:
        return int(ins.operands[0])
    except ValueError:
        return None


def _fused_body(mod: hlo.Module, ins: hlo.Instr) -> hlo.Computation | None:
    m = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
    return mod.computations.get(m.group(1)) if m else None


def _reads(mod: hlo.Module, body: hlo.Computation, name: str) -> tuple[str, int]:
    """How a fusion body uses its value `name`: ("slices", bytes) when every use is a
    dynamic-slice (through bitcasts and nested fusions), ("update", bytes) when every use is the
    buffer a dynamic-update-slice writes in place, else ("whole", 0)."""
    kinds: set[str] = set()
    total = 0
    for u in body.instrs.values():
        for pos, op in enumerate(u.operands):
            if op != name:
                continue
            if u.opcode == "bitcast":
                kind, b = _reads(mod, body, u.name)
            elif u.opcode == "dynamic-slice" and pos == 0:
                kind, b = "slices", u.bytes
            elif u.opcode == "dynamic-update-slice" and pos == 0:
                kind, b = "update", sum(a.bytes for a in hlo.operand_leaves(body, u, 1))
            elif u.opcode == "fusion" and (inner := _fused_body(mod, u)) is not None:
                p = next((i for i in inner.instrs.values() if _param_index(i) == pos), None)
                kind, b = _reads(mod, inner, p.name) if p is not None else ("whole", 0)
            else:
                kind, b = "whole", 0
            kinds.add(kind)
            total += b
    if len(kinds) == 1 and kinds != {"whole"}:
        return kinds.pop(), total
    return "whole", 0


def _fusion_traffic(mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr) -> tuple[float, int]:
    """(matmul FLOPs, bytes moved) of one fusion instruction."""
    body = _fused_body(mod, ins)
    operand_bytes = [
        sum(a.bytes for a in hlo.operand_leaves(comp, ins, i)) for i in range(len(ins.operands))
    ]
    if body is None:
        return 0.0, ins.bytes + sum(operand_bytes)
    flops = 0.0
    stack = [body]
    while stack:  # matmuls may sit in nested fusions
        b = stack.pop()
        for i in b.instrs.values():
            if (f := hlo.instr_flops(b, i)) is not None:
                flops += f
            elif i.opcode == "fusion" and (inner := _fused_body(mod, i)) is not None:
                stack.append(inner)
    params = {_param_index(i): i for i in body.instrs.values() if i.opcode == "parameter"}
    moved = 0
    in_place = 0
    for idx, full in enumerate(operand_bytes):
        p = params.get(idx)
        kind, b = _reads(mod, body, p.name) if p is not None else ("whole", 0)
        if kind == "slices":
            moved += min(full, b)
        elif kind == "update":
            moved += 2 * b  # read and written in place
            in_place += full
        else:
            moved += full
    # A result written in place over an operand moves only its update (counted above).
    moved += max(ins.bytes - in_place, 0)
    return flops, moved


def _traffic(mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr) -> tuple[float, int]:
    """(matmul FLOPs, bytes moved) of one executed instruction that is not a collective."""
    if ins.opcode == "fusion":
        return _fusion_traffic(mod, comp, ins)
    if ins.opcode == "dynamic-slice":  # reads the slice, not the array it cuts from
        return 0.0, 2 * ins.bytes
    if ins.opcode == "dynamic-update-slice":  # writes its update in place
        return 0.0, 2 * sum(a.bytes for a in hlo.operand_leaves(comp, ins, 1))
    return hlo.instr_flops(comp, ins) or 0.0, ins.bytes + hlo.operand_bytes(comp, ins)


@dataclass
class _Roofline:
    """The times and totals `estimate` adds up on chip `c`, instruction by instruction."""

    c: Chip
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    kernel_bytes: float = 0.0
    flops_total: float = 0.0
    bytes_total: float = 0.0
    # (seconds, name, opcode, FLOPs, bytes) of every costed instruction, for `largest`.
    costs: list[tuple[float, str, str, float, float]] = field(default_factory=list)

    def add(self, mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr, w: int) -> None:
        """Cost one instruction at the top of `comp`, which runs `w` times a step."""
        op = ins.opcode
        if op in _SKIP or op.endswith(("-done", "-update")):
            return
        kind = hlo.KIND_OF.get(op)
        if kind is not None:
            self.comm_s += (
                w * hlo.collective_bytes(comp, ins, kind) / self.c.interconnect_bytes_per_s
            )
            return
        if op == "async-start":
            return  # the wrapped computation is walked on its own
        if op == "custom-call" and _KERNEL.search(ins.attrs):
            self.kernel_bytes += w * (ins.bytes + hlo.operand_bytes(comp, ins))
            return
        flops, moved = _traffic(mod, comp, ins)
        t_flops, t_bytes = flops / self.c.peak_flops, moved / self.c.hbm_bytes_per_s
        self.flops_total += w * flops
        self.bytes_total += w * moved
        self.costs.append((w * max(t_flops, t_bytes), ins.name, op, w * flops, w * moved))
        if t_flops >= t_bytes:
            self.compute_s += w * t_flops
        else:
            self.memory_s += w * t_bytes

    def add_kernels(self, kernel_flops: float) -> None:
        """Fused kernels: their analytic FLOPs against peak, or their bytes, whichever is longer."""
        k_flops_s = kernel_flops / self.c.peak_flops
        k_bytes_s = self.kernel_bytes / self.c.hbm_bytes_per_s
        if k_flops_s >= k_bytes_s:
            self.compute_s += k_flops_s
        else:
            self.memory_s += k_bytes_s

    def report(
        self, kernel_flops: float, tokens_per_step: int | None, devices: int, top: int
    ) -> dict[str, Any]:
        c = self.c
        step_s = self.compute_s + self.memory_s + self.comm_s
        parts = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.comm_s}
        out: dict[str, Any] = {
            "step_seconds": round(step_s, 6),
            "bound": max(parts, key=parts.get),
            "seconds": {k: round(v, 6) for k, v in parts.items()},
            "matmul_flops_per_chip": self.flops_total + kernel_flops,
            "hbm_bytes_per_chip": self.bytes_total + self.kernel_bytes,
            "chip": {
                "name": c.name,
                "peak_flops": c.peak_flops,
                "hbm_bytes_per_s": c.hbm_bytes_per_s,
                "interconnect_bytes_per_s": c.interconnect_bytes_per_s,
            },
        }
        out["largest"] = [
            {"name": name, "opcode": op, "seconds": round(t, 6), "flops": f, "bytes": b}
            for t, name, op, f, b in sorted(self.costs, reverse=True)[:top]
        ]
        if tokens_per_step and step_s > 0:
            out["tokens_per_s_per_chip"] = round(tokens_per_step / devices / step_s)
        return out


def estimate(
    text: str | hlo.Module,
    c: Chip,
    *,
    kernel_flops: float = 0.0,
    tokens_per_step: int | None = None,
    devices: int = 1,
    top: int = 8,
) -> dict[str, Any]:
    """The predicted step time of one compiled module (per chip) on chip `c`."""
    mod = hlo.module_of(text)
    weight, how, _ = mod.weights()
    roofline = _Roofline(c)
    for comp in mod.computations.values():
        w = weight.get(comp.name, 0)
        if w == 0 or how.get(comp.name) in ("fusion", "to_apply"):
            continue  # a fusion's body is costed as its one fusion instruction
        for ins in comp.instrs.values():
            roofline.add(mod, comp, ins, w)
    roofline.add_kernels(kernel_flops)
    return roofline.report(kernel_flops, tokens_per_step, devices, top)
