"""Reading a compiled program's HLO text: matmul FLOPs, collectives and the largest buffers.

Backend-neutral: the same reader serves TPU, GPU and CPU programs. Every computation is weighted
by how many times one run of the entry computation executes it: a `while` body by its trip count
(XLA's `known_trip_count`, else the constant its condition compares the counter with), fusions,
calls and async wrappers once per execution of their caller, and each of a conditional's n
branches 1/n times (it runs one; weights may be fractional). So a
scanned layer stack counts every layer, which `compiled.cost_analysis()` does not on TPU (it
counts a loop body once) and cannot on GPU (it returns None).

FLOPs are 2 x multiply-adds of `dot`, `convolution` (TPU lowers matmuls to convolutions) and
cuBLAS gemm custom calls; elementwise work is not counted, so the figure is the matmul FLOPs an
MFU is computed from. Custom calls this reader cannot size (fused attention kernels) are
counted by name, so a report can say what it left out.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_CALL_ATTR = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALL_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')

COLLECTIVE_KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "send",
    "recv",
)
# The collective kind each opcode (and its async -start form) is counted under.
KIND_OF = {
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-to-all": "all-to-all",
    "all-to-all-start": "all-to-all",
    "ragged-all-to-all": "all-to-all",
    "ragged-all-to-all-start": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-permute",
    "send": "send",
    "recv": "recv",
}
# Ops that name a buffer another op already owns: not buffers of their own.
VIEWS = {"get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
          "replica-id"}  # fmt: skip


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.ceil(math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def arrays(type_text: str) -> list[Array]:
    """The array leaves of an HLO type (`f32[8,64]{1,0}` or a tuple of them), in order."""
    return [
        Array(d, tuple(int(x) for x in dims.split(",") if x))
        for d, dims in _ARRAY.findall(type_text)
        if d in _DTYPE_BYTES
    ]


@dataclass
class Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str

    @property
    def leaves(self) -> list[Array]:
        return arrays(self.type_text)

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.leaves)


@dataclass
class Computation:
    name: str
    entry: bool
    instrs: dict[str, Instr] = field(default_factory=dict)


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    quote = False
    for j in range(i, len(s)):
        c = s[j]
        if quote:
            if c == '"' and s[j - 1] != "\\":
                quote = False
            continue
        if c == '"':
            quote = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        out.append("".join(cur))
    return [p.strip() for p in out if p.strip()]


_INSTR_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_COMMENT = re.compile(r"/\*.*?\*/")


def parse_instr(line: str) -> Instr | None:
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    type_text, rest = rest[:end], rest[end:]
    om = _OPCODE.match(rest)
    if not om:
        return None
    open_at = om.end() - 1
    close = _balanced(rest, open_at)
    args = rest[open_at + 1 : close - 1]
    # Long operand lists carry `/*index=5*/` comments glued to the next operand's name.
    operands = [_COMMENT.sub(" ", p).split()[-1].lstrip("%") for p in _split_top(args)]
    return Instr(m.group(1), type_text, om.group(1), operands, rest[close:])


@dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        comps: dict[str, Computation] = {}
        cur: Computation | None = None
        entry = ""
        for line in text.splitlines():
            if cur is None:
                h = _HEADER.match(line)
                if h and not line.startswith((" ", "\t")):
                    cur = Computation(h.group(2), bool(h.group(1)))
                    if cur.entry:
                        entry = cur.name
                continue
            if line.strip() == "}":
                comps[cur.name] = cur
                cur = None
                continue
            ins = parse_instr(line)
            if ins is not None:
                cur.instrs[ins.name] = ins
        if not entry and comps:
            entry = list(comps)[-1]
        return cls(comps, entry)

    def trip_count(self, ins: Instr) -> int | None:
        """How many times the `while` instruction `ins` runs its body, or None if unknown."""
        m = _TRIP.search(ins.attrs)
        if m:
            return int(m.group(1))
        cm = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
        cond = self.computations.get(cm.group(1)) if cm else None
        if cond is None:
            return None
        for c in cond.instrs.values():
            if c.opcode == "compare" and "direction=LT" in c.attrs:
                for op in c.operands:
                    k = cond.instrs.get(op)
                    if k is not None and k.opcode == "constant" and k.operands:
                        if re.fullmatch(r"-?\d+", k.operands[0]):
                            return int(k.operands[0])
        return None

    def weights(self) -> tuple[dict[str, float], dict[str, str], int]:
        """(executions of each computation per run, how each is called, loops of unknown trip
        count, counted once)."""
        edges: dict[str, list[tuple[str, float]]] = defaultdict(list)
        how: dict[str, str] = {}
        unknown = 0
        for comp in self.computations.values():
            for ins in comp.instrs.values():
                if ins.opcode.endswith(("-done", "-update")):
                    continue  # the -start (or async-start) already called it
                trips = 1
                if ins.opcode == "while":
                    t = self.trip_count(ins)
                    if t is None:
                        unknown += 1
                    trips = t if t is not None else 1
                for kind, callee in _CALL_ATTR.findall(ins.attrs):
                    edges[comp.name].append((callee, trips if kind == "body" else 1))
                    how.setdefault(callee, "fusion" if ins.opcode == "fusion" else kind)
                for kind, names in _CALL_LIST.findall(ins.attrs):
                    callees = [n.strip().lstrip("%") for n in names.split(",") if n.strip()]
                    # A conditional runs one of its branches: each counts as its share (the
                    # branches of a context-parallel switch are the devices' equal parts).
                    share = 1 / len(callees) if kind == "branch_computations" else 1
                    for callee in callees:
                        edges[comp.name].append((callee, share))
                        how.setdefault(callee, "call")
        indeg: dict[str, int] = defaultdict(int)
        for callees in edges.values():
            for c, _ in callees:
                indeg[c] += 1
        weight: dict[str, float] = {name: 0 for name in self.computations}
        weight[self.entry] = 1
        queue = deque(n for n in self.computations if indeg[n] == 0)
        while queue:
            u = queue.popleft()
            for v, f in edges.get(u, ()):
                if v in weight:
                    weight[v] += weight[u] * f
                indeg[v] -= 1
                if indeg[v] == 0:
                    queue.append(v)
        return weight, how, unknown


def _dims_attr(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _json_dims(attrs: str, key: str) -> list[int]:
    m = re.search(rf'"{key}":\[([^\]]*)\]', attrs)
    return [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')] if m else []


def operand_leaves(comp: Computation, ins: Instr, i: int) -> list[Array]:
    """The array leaves of operand `i` of `ins` (empty if `comp` does not define it)."""
    if i >= len(ins.operands):
        return []
    src = comp.instrs.get(ins.operands[i])
    return src.leaves if src is not None else []


def instr_flops(comp: Computation, ins: Instr) -> float | None:
    """2 x multiply-adds of one matmul-like instruction; None if it is not one."""
    out = ins.leaves
    if not out:
        return None
    if ins.opcode == "dot":
        lhs = operand_leaves(comp, ins, 0)
        if not lhs:
            return None
        k = math.prod(lhs[0].dims[d] for d in _dims_attr(ins.attrs, "lhs_contracting_dims"))
        return 2.0 * math.prod(out[0].dims) * k
    if ins.opcode == "convolution":
        return _conv_flops(comp, ins, out[0])
    if ins.opcode == "custom-call" and re.search(
        r'custom_call_target="[^"]*(gemm|matmul)', ins.attrs
    ):
        lhs = operand_leaves(comp, ins, 0)
        if not lhs:
            return None
        k = math.prod(lhs[0].dims[d] for d in _json_dims(ins.attrs, "lhs_contracting_dimensions"))
        return 2.0 * math.prod(out[0].dims) * k
    return None


def _window(attrs: str, key: str, n: int, default: int) -> list[tuple[int, ...]]:
    m = re.search(rf"\b{key}=([0-9_x-]+)", attrs)
    if not m:
        return [(default,)] * n
    return [tuple(int(v) for v in part.split("_")) for part in m.group(1).split("x")]


def _conv_flops(comp: Computation, ins: Instr, out: Array) -> float | None:
    """2 x the multiply-adds that touch real input: TPU expresses batched matmuls as
    convolutions whose dilated or padded window positions hit holes, which do no work."""
    lhs, rhs = operand_leaves(comp, ins, 0), operand_leaves(comp, ins, 1)
    m = re.search(r"dim_labels=([^_]+)_([^-]+)->([^,\s]+)", ins.attrs)
    if not lhs or not rhs or not m:
        return None
    ll, rl, ol = m.groups()
    n = sum(c.isdigit() for c in ll)
    wm = re.search(r"window=\{([^}]*)\}", ins.attrs)
    w = wm.group(1) if wm else ""
    size = [s[0] for s in _window(w, "size", n, 1)]
    stride = [s[0] for s in _window(w, "stride", n, 1)]
    pad = _window(w, "pad", n, 0)
    lhs_dil = [s[0] for s in _window(w, "lhs_dilate", n, 1)]
    rhs_dil = [s[0] for s in _window(w, "rhs_dilate", n, 1)]
    work = 1
    for d in range(n):
        size_in = lhs[0].dims[ll.index(str(d))]
        size_out = out.dims[ol.index(str(d))]
        lo = pad[d][0] if pad[d] else 0
        extent = (size_in - 1) * lhs_dil[d]
        valid = 0
        for o in range(size_out):
            for k in range(size[d]):
                r = o * stride[d] + k * rhs_dil[d] - lo
                if 0 <= r <= extent and r % lhs_dil[d] == 0:
                    valid += 1
        work *= valid
    features_in = rhs[0].dims[rl.index("i")]
    return 2.0 * out.dims[ol.index("b")] * out.dims[ol.index("f")] * features_in * work


def _custom_target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return m.group(1) if m else "?"


def operand_bytes(comp: Computation, ins: Instr) -> int:
    """Bytes of all the operands of `ins`."""
    return sum(a.bytes for i in range(len(ins.operands)) for a in operand_leaves(comp, ins, i))


def collective_bytes(comp: Computation, ins: Instr, kind: str) -> int:
    """Per-device payload: all-gather its gathered result, a ragged all-to-all the most rows it
    can send (its input or its output buffer, the smaller: the rest is padding), the others
    their operands."""
    if ins.opcode.startswith("ragged-all-to-all"):
        sent = sum(a.bytes for a in operand_leaves(comp, ins, 0))
        room = ins.leaves[-1].bytes if ins.leaves else sent  # the output (last of a -start)
        return min(sent, room)
    ins_bytes = operand_bytes(comp, ins)
    if kind == "all-gather":
        leaves = [a for a in ins.leaves if a.dims]  # drop scalar sync flags of -start tuples
        n = len(ins.operands)
        if ins.opcode.endswith("-start") and len(leaves) >= 2 * n:
            leaves = leaves[-n:]
        return sum(a.bytes for a in leaves)
    if kind in ("send", "recv") and not ins_bytes:
        leaves = ins.leaves
        return leaves[0].bytes if leaves else 0
    if kind == "recv":
        return ins.leaves[0].bytes if ins.leaves else 0
    return ins_bytes


def replica_groups(attrs: str) -> list[list[int]] | None:
    """The device groups of a collective (explicit, iota or mesh form), or None if absent or
    in a form this reader does not know. Collective-permute pairs count as groups of two."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [
            [int(x) for x in p.split(",")] for p in re.findall(r"\{([0-9,]+)", m.group(1) + "}")
        ]
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", attrs)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2)) if a in names]
        others = [i for i in range(len(names)) if i not in grouped]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(others + grouped)
        return ids.reshape(-1, math.prod(sizes[i] for i in grouped) if grouped else 1).tolist()
    return None


def _empty_kinds() -> dict[str, dict[str, int]]:
    return {k: {"count": 0, "bytes": 0} for k in COLLECTIVE_KINDS}


def _total(kinds: dict[str, dict[str, int]]) -> dict[str, int]:
    return {n: sum(v[n] for v in kinds.values()) for n in ("count", "bytes")}


def _buffer_row(ins: Instr) -> dict:
    """One buffer of the report: its shape (the first 4 leaves), size and the op that made it."""
    op = re.search(r'op_name="([^"]*)"', ins.attrs)
    return {
        "name": ins.name,
        "shape": ", ".join(str(a) for a in ins.leaves[:4])
        + (", ..." if len(ins.leaves) > 4 else ""),
        "dims": [list(a.dims) for a in ins.leaves[:4]],
        "bytes": ins.bytes,
        "opcode": ins.opcode,
        "op_name": op.group(1)[-120:] if op else None,
    }


@dataclass
class _Tally:
    """What `analyse` adds up over the executed instructions, each weighted by its executions.

    `slice_of` is set only when the devices span more than one slice: it is what places a
    collective across slices.
    """

    slice_of: list[int] | None
    flops: float = 0.0
    unsized: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    within: dict[str, dict[str, int]] = field(default_factory=_empty_kinds)
    across: dict[str, dict[str, int]] = field(default_factory=_empty_kinds)
    unknown_scope: dict[str, dict[str, int]] = field(default_factory=_empty_kinds)
    ragged: dict[str, int] = field(default_factory=lambda: {"count": 0, "bytes": 0})
    buffers: dict[str, dict] = field(default_factory=dict)
    loops: list[dict] = field(default_factory=list)

    def add(self, mod: Module, comp: Computation, ins: Instr, w: int, materialised: bool) -> None:
        """Count one instruction of `comp`, which runs `w` times a run."""
        self._count_flops(comp, ins, w)
        if ins.opcode == "while":
            self.loops.append({"name": ins.name, "trip_count": mod.trip_count(ins)})
        kind = KIND_OF.get(ins.opcode)
        if kind is None and ins.opcode == "async-start":
            return  # its wrapped computation holds the collective, counted there
        if kind is not None:
            self._count_collective(comp, ins, kind, w)
        if materialised and ins.opcode not in VIEWS and ins.leaves:
            b = ins.bytes
            if b and (ins.name not in self.buffers or self.buffers[ins.name]["bytes"] < b):
                self.buffers[ins.name] = _buffer_row(ins)

    def _count_flops(self, comp: Computation, ins: Instr, w: int) -> None:
        f = instr_flops(comp, ins)
        if f is not None:
            self.flops += w * f
        elif ins.opcode == "custom-call":
            target = _custom_target(ins)
            if not target.startswith(("Sharding", "SPMD", "AllocateBuffer")):
                self.unsized[target] += w

    def _count_collective(self, comp: Computation, ins: Instr, kind: str, w: int) -> None:
        nbytes = collective_bytes(comp, ins, kind)
        scope = self._scope(ins)
        scope[kind]["count"] += w
        scope[kind]["bytes"] += w * nbytes
        if ins.opcode.startswith("ragged-all-to-all"):  # also counted as all-to-all
            self.ragged["count"] += w
            self.ragged["bytes"] += w * nbytes

    def _scope(self, ins: Instr) -> dict[str, dict[str, int]]:
        """The tally a collective belongs to: within a slice, across slices, or unknown."""
        if self.slice_of is None:
            return self.within
        if "_xla_megascale_transfer_type" in ins.attrs:
            return self.across
        groups = replica_groups(ins.attrs)
        if groups is None:
            return self.unknown_scope
        slice_of = self.slice_of
        if any(len({slice_of[d] for d in g if d < len(slice_of)}) > 1 for g in groups):
            return self.across
        return self.within

    def report(self, unknown_loops: int, top: int) -> dict:
        scopes = (self.within, self.across, self.unknown_scope)
        by_kind = {
            k: {n: sum(s[k][n] for s in scopes) for n in ("count", "bytes")}
            for k in COLLECTIVE_KINDS
        }
        return {
            "matmul_flops": self.flops,
            "uncounted_custom_calls": _whole(dict(self.unsized)),
            "loops": self.loops,
            "loops_of_unknown_trip_count": unknown_loops,
            "collectives": _whole(
                {
                    "total": _total(by_kind),
                    "by_kind": by_kind,
                    "within_slice": self.within,
                    "across_slices": self.across,
                    "unknown_scope": self.unknown_scope,
                    # The MoE dispatch's exchanges (runtime/model/moe/dispatch.py), a part of
                    # all-to-all; bytes are the most rows each can send (dropless: every assignment).
                    "ragged_all_to_all": self.ragged,
                }
            ),
            "largest_buffers": sorted(self.buffers.values(), key=lambda b: -b["bytes"])[:top],
            "all_buffers": list(self.buffers.values()),
        }


def _whole(x: Any) -> Any:
    """Counts and bytes as integers (a conditional's branches weigh fractions of a run)."""
    if isinstance(x, dict):
        return {k: _whole(v) for k, v in x.items()}
    return round(x) if isinstance(x, float) else x


def module_of(text: str | Module) -> Module:
    """`text` parsed, or the module itself when a caller parsed it already: `runtime plan`
    parses a compiled program once for its FLOPs, collectives and step time (a real model's
    text runs to hundreds of thousands of lines)."""
    return text if isinstance(text, Module) else Module.parse(text)


def analyse(text: str | Module, slice_of: list[int] | None = None, top: int = 10) -> dict:
    """Matmul FLOPs, collectives and largest buffers of one compiled module, per device.

    `slice_of[i]` is the slice of logical device i (the i-th device of the mesh); with more than
    one slice, a collective is `across_slices` if it is tagged as a megascale (DCN) transfer or
    one of its groups spans slices, `within_slice` otherwise (`unknown_scope` if its groups are
    in a form this reader does not know).
    """
    mod = module_of(text)
    weight, how, unknown_loops = mod.weights()
    multi = slice_of is not None and len(set(slice_of)) > 1
    tally = _Tally(slice_of if multi else None)
    for comp in mod.computations.values():
        w = weight.get(comp.name, 0)
        if w == 0:
            continue
        # A fusion body's (or a reduction's applied) values are no buffers of their own.
        materialised = how.get(comp.name) not in ("fusion", "to_apply")
        for ins in comp.instrs.values():
            tally.add(mod, comp, ins, w, materialised)
    return tally.report(unknown_loops, top)
