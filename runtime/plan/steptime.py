"""A predicted step time from the compiled program: a roofline per executed instruction.

Every instruction that runs at the top of a computation (the entry, loop bodies, called and
branch computations; a fusion is one instruction, its body is not walked) costs
max(its matmul FLOPs / the FLOP/s XLA's fusions sustain, the HBM bytes it moves / the bandwidth
streaming sustains), times how often it runs (`hlo.Module.weights`: a scanned layer stack counts
every layer). What it moves is its operands read and its result written, except that an operand
a fusion only dynamic-slices or gathers from is charged what it takes, a buffer a fusion dynamic-update-slices in place is charged the update (read
and written), and a buffer in the TPU's on-chip memory (layout `S(1)`, where XLA prefetches) is
no HBM traffic at all: a scan reading one layer of a stacked array moves that layer, not the stack.

Asynchronous copies and slices (`copy-start`, `slice-start`: DMAs that XLA issues ahead of their
use) move their destination's bytes on each HBM side, and run beside the computation's other
instructions: they cost time only where they exceed the HBM time that compute-bound
instructions of the same computation leave idle.

Kernels (Pallas custom calls) are sized from their operands where the program names them:
splash attention's forward (2 matmuls over the blocks the causal mask keeps: QK^T, PV), dq (3:
QK^T again, dO V^T, dS K) and dkv (4: QK^T, dO V^T, P^T dO, dS^T Q), and megablox's grouped
matmuls (`gmm`, `tgmm`: 2 x rows x the two widths). They run at the chip's measured kernel
efficiency (`chips.toml`: device time on the chip against the FLOPs at peak, per kernel and
block size), not at peak: a kernel's softmax and per-block work do not overlap its matmuls
fully. Other fused kernels (cuDNN attention) get the analytic attention FLOPs the caller passes
(`kernel_flops`) against peak, when no attention kernel was sized from the program. A gather
from HBM costs at least its rows at the chip's measured time per row (one DMA each). Collectives
cost their payload over the chip's interconnect bandwidth (one direction), added to the
compute: no overlap is assumed.

The estimate's `bound` is the largest of the three parts: compute (FLOP-limited instructions and
kernels), memory (byte-limited instructions) or communication. The chip figures are in
`chips.toml` beside this file, each with its source: the vendors' peak and bandwidths, and the
fractions of them measured on the chip. Where a chip has no measured figure its instructions and
kernels run at the roofs, which makes the estimate a lower bound there.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from runtime.plan import hlo

_CHIPS = Path(__file__).with_name("chips.toml")
_SKIP = hlo.VIEWS | {"parameter", "while", "call", "conditional", "async-done", "copy-done",
                      "send-done", "recv-done", "domain", "opt-barrier"}  # fmt: skip
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[^"]*)"')
# Custom calls that only name memory: an allocation, or slices laid side by side as one buffer.
_FREE_CALLS = re.compile(r'custom_call_target="(AllocateBuffer|ConcatBitcast)"')
# An array leaf of an HLO type with its layout, whose `S(n)` names its memory space.
_LEAF = re.compile(r"\b[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_HBM = 0  # the default memory space; 1 is on-chip memory, 2 scalar memory, 5 the host's
# Splash attention's kernels by instruction name, and the matmuls each runs per kept block.
_SPLASH = re.compile(r"^splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}
_GMM = re.compile(r"^(t?gmm)\b")


@dataclass(frozen=True)
class Chip:
    """One chip's figures (chips.toml): its roofs, and what it was measured to sustain."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    interconnect_bytes_per_s: float  # one direction, per chip
    # Measured kernel efficiency (device time against FLOPs at peak): "splash_fwd@1024", "gmm".
    kernels: dict[str, float] = field(default_factory=dict)
    gather_row_s: float = 0.0  # measured seconds per row of a gather from HBM (one DMA each)
    # Measured fractions of the roofs that XLA's own instructions sustain.
    matmul_efficiency: float = 1.0
    hbm_efficiency: float = 1.0

    @property
    def xla_flops(self) -> float:
        """The FLOP/s XLA's matmul fusions sustain."""
        return self.peak_flops * self.matmul_efficiency

    @property
    def hbm(self) -> float:
        """The HBM bytes/s a streaming instruction sustains."""
        return self.hbm_bytes_per_s * self.hbm_efficiency


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, Any]]:
    with open(_CHIPS, "rb") as f:
        return tomllib.load(f)["chip"]


def chip(name: str, peak_flops: float | None) -> Chip | None:
    """The chip figures for a catalogue name (tpu-v5e, h100-80gb, ...), or None if unknown."""
    row = _table().get(name)
    if row is None or not peak_flops:
        return None
    return Chip(
        name,
        peak_flops,
        row["hbm_gb_per_s"] * 1e9,
        row["interconnect_gb_per_s"] * 1e9,
        kernels=dict(row.get("kernel_efficiency", {})),
        gather_row_s=row.get("gather_row_ns", 0.0) * 1e-9,
        matmul_efficiency=row.get("matmul_efficiency", 1.0),
        hbm_efficiency=row.get("hbm_efficiency", 1.0),
    )


def _spaces(type_text: str) -> list[tuple[hlo.Array, int]]:
    """The array leaves of an HLO type with the memory space of each (0: HBM)."""
    out = []
    for m in _LEAF.finditer(type_text):
        arr = hlo.arrays(m.group(0))
        if arr:
            s = _SPACE.search(m.group(1) or "")
            out.append((arr[0], int(s.group(1)) if s else _HBM))
    return out


def hbm_bytes(type_text: str) -> int:
    """Bytes of the leaves of an HLO type that live in HBM (not on-chip memory, not the host)."""
    return sum(a.bytes for a, space in _spaces(type_text) if space == _HBM)


def _operand_hbm(comp: hlo.Computation, ins: hlo.Instr, i: int) -> int:
    src = comp.instrs.get(ins.operands[i]) if i < len(ins.operands) else None
    return hbm_bytes(src.type_text) if src is not None else 0


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
    dynamic-slice or a gather from it (through bitcasts and nested fusions), ("update", bytes) when every use is the
    buffer a dynamic-update-slice writes in place, else ("whole", 0)."""
    kinds: set[str] = set()
    total = 0
    for u in body.instrs.values():
        for pos, op in enumerate(u.operands):
            if op != name:
                continue
            if u.opcode == "bitcast":
                kind, b = _reads(mod, body, u.name)
            elif u.opcode in ("dynamic-slice", "gather") and pos == 0:
                kind, b = "slices", u.bytes  # reads what it takes, not the whole array
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


def _body_instrs(
    mod: hlo.Module, body: hlo.Computation
) -> Iterator[tuple[hlo.Computation, hlo.Instr]]:
    """Every instruction of a fusion body, nested fusions' bodies included."""
    stack = [body]
    while stack:
        b = stack.pop()
        for i in b.instrs.values():
            yield b, i
            if i.opcode == "fusion" and (inner := _fused_body(mod, i)) is not None:
                stack.append(inner)


def _gather_rows(mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr) -> int:
    """Rows an instruction gathers from an HBM operand (0 when it gathers nothing from HBM):
    each is a DMA of its own. A fusion's gathers read its parameters, which live where the
    fusion's operands do."""
    if ins.opcode == "gather":
        return _rows(ins) if _operand_hbm(comp, ins, 0) else 0
    body = _fused_body(mod, ins) if ins.opcode == "fusion" else None
    if body is None:
        return 0
    rows = 0
    for b, g in _body_instrs(mod, body):
        src = b.instrs.get(g.operands[0]) if g.opcode == "gather" and g.operands else None
        idx = _param_index(src) if src is not None else None
        if idx is not None and b is body and _operand_hbm(comp, ins, idx):
            rows += _rows(g)
    return rows


def _rows(g: hlo.Instr) -> int:
    """Slices a gather takes: its result's elements over one slice's."""
    m = re.search(r"slice_sizes=\{([0-9,]*)\}", g.attrs)
    size = math.prod(int(x) for x in m.group(1).split(",") if x) if m else 1
    out = g.leaves
    return math.prod(out[0].dims) // max(size, 1) if out else 0


def _fusion_traffic(mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr) -> tuple[float, int]:
    """(matmul FLOPs, HBM bytes moved) of one fusion instruction."""
    body = _fused_body(mod, ins)
    operand_bytes = [_operand_hbm(comp, ins, i) for i in range(len(ins.operands))]
    result = hbm_bytes(ins.type_text)
    if body is None:
        return 0.0, result + sum(operand_bytes)
    flops = 0.0
    for b, i in _body_instrs(mod, body):  # matmuls may sit in nested fusions
        flops += hlo.instr_flops(b, i) or 0.0
    params = {_param_index(i): i for i in body.instrs.values() if i.opcode == "parameter"}
    moved = 0
    in_place = 0
    for idx, full in enumerate(operand_bytes):
        p = params.get(idx)
        kind, b = _reads(mod, body, p.name) if p is not None and full else ("whole", 0)
        if kind == "slices":
            moved += min(full, b)
        elif kind == "update":
            moved += 2 * b  # read and written in place
            in_place += full
        else:
            moved += full
    # A result written in place over an operand moves only its update (counted above).
    moved += max(result - in_place, 0)
    return flops, moved


def _traffic(mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr) -> tuple[float, int]:
    """(matmul FLOPs, HBM bytes moved) of one executed instruction that is not a collective."""
    if ins.opcode == "fusion":
        return _fusion_traffic(mod, comp, ins)
    result = hbm_bytes(ins.type_text)
    if ins.opcode == "dynamic-slice":  # reads the slice, not the array it cuts from
        return 0.0, result + (ins.bytes if _operand_hbm(comp, ins, 0) else 0)
    if ins.opcode == "dynamic-update-slice":  # writes its update in place
        return 0.0, 2 * _operand_hbm(comp, ins, 1)
    operands = sum(_operand_hbm(comp, ins, i) for i in range(len(ins.operands)))
    return hlo.instr_flops(comp, ins) or 0.0, result + operands


def _async_bytes(ins: hlo.Instr) -> int:
    """HBM bytes an asynchronous copy or slice moves: its destination (the result's second
    leaf; the first is the source), on each side that is HBM."""
    leaves = _spaces(ins.type_text)
    if len(leaves) < 2:
        return 0
    (_, src_space), (dst, dst_space) = leaves[0], leaves[1]
    return dst.bytes * ((src_space == _HBM) + (dst_space == _HBM))


def _splash_flops(comp: hlo.Computation, ins: hlo.Instr, kind: str) -> tuple[float, int]:
    """(FLOPs, block size) of one splash kernel call: its matmuls over the query/key blocks a
    causal mask keeps (of n x n blocks, n(n+1)/2; a diagonal block is computed whole). Its
    operands: the mask's block tables ([heads, n, n] integers), then q ([batch..., heads, T,
    head_dim]; a batch of one has no batch axis), k and v."""
    leaves = [comp.instrs[o].leaves for o in ins.operands if o in comp.instrs]
    arrays = [a[0] for a in leaves if a]
    first = next((i for i, a in enumerate(arrays) if a.dtype in ("bf16", "f32", "f16")), None)
    if first is None or len(arrays) < first + 2 or len(arrays[first].dims) < 3:
        return 0.0, 0
    q, k = arrays[first].dims, arrays[first + 1].dims
    grids = [a.dims for a in arrays[:first] if len(a.dims) == 3]
    n = grids[0][1] if grids else 1
    # A square grid is a causal sequence; a wide one (q blocks x more kv blocks) is a chunk of
    # a sequence split by mesh.context: a device's two chunks of the balanced layout keep half
    # of their blocks between them (runtime/model/attention/context_parallel.py).
    kept = ((n + 1) / (2 * n) if grids[0][1] == grids[0][2] else 0.5) if grids else 1.0
    rows = math.prod(q[:-1])  # batch x heads x T query rows
    flops = _SPLASH_MATMULS[kind] * 2.0 * rows * k[-2] * q[-1] * kept
    return flops, q[-2] // max(n, 1)


def _kernel_efficiency(c: Chip, kind: str, block: int | None) -> float:
    """The chip's measured efficiency of a kernel; for splash the nearest measured block size
    (log scale). 1.0 (peak) where the chip has no figure."""
    if block is None:
        return c.kernels.get(kind, 1.0)
    sizes = [int(k.split("@")[1]) for k in c.kernels if k.startswith(f"{kind}@")]
    if not sizes or not block:
        return 1.0
    near = min(sizes, key=lambda s: abs(math.log2(s) - math.log2(block)))
    return c.kernels[f"{kind}@{near}"]


def _gmm_flops(comp: hlo.Computation, ins: hlo.Instr) -> float:
    """A grouped matmul's FLOPs: each row of the 2-D operand meets one group, so 2 x rows x the
    contracted width x the output width (gmm: lhs [m, k], result [m, n]; tgmm: result
    [groups, k, n] from two [m, .] operands)."""
    ops = [comp.instrs.get(o) for o in ins.operands]
    two_d = [o.leaves[0].dims for o in ops if o is not None and len(o.leaves[0].dims) == 2]
    out = ins.leaves[0].dims if ins.leaves else ()
    if not two_d or not out:
        return 0.0
    if len(out) == 3:  # tgmm
        _, k, n = out
        m = max(two_d[0])
        return 2.0 * m * k * n
    m, k = two_d[0]
    return 2.0 * m * k * out[-1]


def _kernel_cost(c: Chip, comp: hlo.Computation, ins: hlo.Instr) -> tuple[str, float, float] | None:
    """(kernel, FLOPs, efficiency) of a custom call sized from its operands, or None."""
    m = _SPLASH.match(ins.name)
    if m:
        flops, block = _splash_flops(comp, ins, m.group(1))
        kind = f"splash_{m.group(1)}"
        return kind, flops, _kernel_efficiency(c, kind, block)
    m = _GMM.match(ins.name)
    if m:
        return m.group(1), _gmm_flops(comp, ins), _kernel_efficiency(c, m.group(1), None)
    return None


@dataclass
class _Part:
    """One computation's times for one execution: compute- and memory-bound instructions, the
    HBM time compute-bound ones leave idle, and the asynchronous copies' HBM time."""

    compute_s: float = 0.0
    memory_s: float = 0.0
    idle_hbm_s: float = 0.0
    async_s: float = 0.0

    def add(self, t_flops: float, t_bytes: float) -> None:
        if t_flops >= t_bytes:
            self.compute_s += t_flops
            self.idle_hbm_s += t_flops - t_bytes
        else:
            self.memory_s += t_bytes

    def memory_with_async(self) -> float:
        """Memory time, with what of the asynchronous copies the idle HBM time cannot hide."""
        return self.memory_s + max(self.async_s - self.idle_hbm_s, 0.0)


@dataclass
class _Roofline:
    """The times and totals `estimate` adds up on chip `c`, instruction by instruction."""

    c: Chip
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    unsized_kernel_bytes: float = 0.0
    attention_sized: bool = False
    flops_total: float = 0.0
    bytes_total: float = 0.0
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)
    # (seconds, name, opcode, FLOPs, bytes) of every costed instruction, for `largest`.
    costs: list[tuple[float, str, str, float, float]] = field(default_factory=list)

    def computation(self, mod: hlo.Module, comp: hlo.Computation, w: int) -> None:
        """Cost the instructions at the top of `comp`, which runs `w` times a step."""
        part = _Part()
        for ins in comp.instrs.values():
            self.add(mod, comp, ins, w, part)
        self.compute_s += w * part.compute_s
        self.memory_s += w * part.memory_with_async()

    def add(
        self, mod: hlo.Module, comp: hlo.Computation, ins: hlo.Instr, w: int, part: _Part
    ) -> None:
        """Cost one instruction into `part` (per execution) and the step's totals."""
        op = ins.opcode
        if op in _SKIP or op.endswith(("-done", "-update")) or _FREE_CALLS.search(ins.attrs):
            return
        kind = hlo.KIND_OF.get(op)
        if kind is not None:
            self.comm_s += (
                w * hlo.collective_bytes(comp, ins, kind) / self.c.interconnect_bytes_per_s
            )
            return
        if op == "async-start":
            return  # the wrapped computation is walked on its own
        if op.endswith("-start"):  # copy-start, slice-start: a DMA beside the other work
            moved = _async_bytes(ins)
            part.async_s += moved / self.c.hbm
            self.bytes_total += w * moved
            return
        if op == "custom-call" and _KERNEL.search(ins.attrs):
            self._kernel(comp, ins, w, part)
            return
        flops, moved = _traffic(mod, comp, ins)
        t_flops, t_bytes = flops / self.c.xla_flops, moved / self.c.hbm
        t_bytes = max(t_bytes, _gather_rows(mod, comp, ins) * self.c.gather_row_s)
        self._charge(ins, op, w, flops, moved, t_flops, t_bytes, part)

    def _kernel(self, comp: hlo.Computation, ins: hlo.Instr, w: int, part: _Part) -> None:
        moved = hbm_bytes(ins.type_text) + sum(
            _operand_hbm(comp, ins, i) for i in range(len(ins.operands))
        )
        sized = _kernel_cost(self.c, comp, ins)
        if sized is None:
            self.unsized_kernel_bytes += w * moved
            return
        kind, flops, eff = sized
        self.attention_sized |= kind.startswith("splash")
        t_flops, t_bytes = flops / (self.c.peak_flops * eff), moved / self.c.hbm
        k = self.kernels.setdefault(kind, {"calls": 0, "flops": 0.0, "seconds": 0.0})
        k["calls"] += w
        k["flops"] += w * flops
        k["seconds"] += w * max(t_flops, t_bytes)
        self._charge(ins, "custom-call", w, flops, moved, t_flops, t_bytes, part)

    def _charge(
        self, ins: hlo.Instr, op: str, w: int, flops: float, moved: float,
        t_flops: float, t_bytes: float, part: _Part,
    ) -> None:  # fmt: skip
        self.flops_total += w * flops
        self.bytes_total += w * moved
        self.costs.append((w * max(t_flops, t_bytes), ins.name, op, w * flops, w * moved))
        part.add(t_flops, t_bytes)

    def add_unsized_kernels(self, kernel_flops: float) -> None:
        """Kernels not sized from the program: the caller's analytic FLOPs against peak (unless
        attention kernels were sized, which they count), or their bytes, whichever is longer."""
        flops = 0.0 if self.attention_sized else kernel_flops
        k_flops_s = flops / self.c.peak_flops
        k_bytes_s = self.unsized_kernel_bytes / self.c.hbm
        if k_flops_s >= k_bytes_s:
            self.compute_s += k_flops_s
        else:
            self.memory_s += k_bytes_s
        self.flops_total += flops
        self.bytes_total += self.unsized_kernel_bytes

    def report(self, tokens_per_step: int | None, devices: int, top: int) -> dict[str, Any]:
        c = self.c
        step_s = self.compute_s + self.memory_s + self.comm_s
        parts = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.comm_s}
        out: dict[str, Any] = {
            "step_seconds": round(step_s, 6),
            "bound": max(parts, key=parts.get),
            "seconds": {k: round(v, 6) for k, v in parts.items()},
            "matmul_flops_per_chip": self.flops_total,
            "hbm_bytes_per_chip": self.bytes_total,
            "kernels": {
                k: {
                    "calls": round(v["calls"]),
                    "flops": v["flops"],
                    "seconds": round(v["seconds"], 6),
                }
                for k, v in sorted(self.kernels.items())
            },
            "chip": {
                "name": c.name,
                "peak_flops": c.peak_flops,
                "hbm_bytes_per_s": c.hbm_bytes_per_s,
                "interconnect_bytes_per_s": c.interconnect_bytes_per_s,
                "kernel_efficiency": dict(c.kernels),
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
    """The predicted step time of one compiled module (per chip) on chip `c`. `kernel_flops`:
    the analytic FLOPs of fused attention kernels the program does not size (cuDNN's)."""
    mod = hlo.module_of(text)
    weight, how, _ = mod.weights()
    roofline = _Roofline(c)
    for comp in mod.computations.values():
        w = weight.get(comp.name, 0)
        if w == 0 or how.get(comp.name) in ("fusion", "to_apply"):
            continue  # a fusion's body is costed as its one fusion instruction
        roofline.computation(mod, comp, w)
    roofline.add_unsized_kernels(kernel_flops)
    return roofline.report(tokens_per_step, devices, top)
