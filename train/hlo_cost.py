"""The cost of one run of a compiled (optimized) HLO module, read from its text: FLOPs, HBM bytes and
collective bytes by kind, with every `while` body counted as many times as the loop runs.

Why not `compiled.cost_analysis()`: XLA's HloCostAnalysis counts a while body once, so a scanned
layer stack counts one layer group and a gradient-accumulation loop one micro-batch. Here the module
text (`compiled.as_text()`) is walked from the entry computation:

- `while`: body + condition x the trip count: the `known_trip_count` of its backend config when
  present, else read from the loop itself: the condition's `compare(counter, constant N)`, the
  counter's start (a constant in the init tuple, else 0) and its step (the body's `add(counter,
  constant s)`). A loop whose count cannot be read counts once and is listed in `unknown_trips`.
- `fusion`: FLOPs of the fused computation; HBM bytes of the fusion's operands and result only
  (what a fused kernel reads and writes), an operand only sliced inside counting its slices, a
  dynamic-update-slice root writing only its update (in place); top-level slices and updates
  likewise. Operands that stay in VMEM / CMEM are counted as HBM traffic (an upper bound).
- `call` / `async-start` / `call-start`: the called computation once; `conditional`: the costliest
  branch (an upper bound: the CE's skip of chunks without loss tokens is data-dependent); how much
  more it costs than the cheapest branch is kept apart (`cond_spread`), so a caller that knows how
  often the costly branch runs can scale it (`HloCost.hbm_at`).
- dots / convolutions (TPU lowers dots to convolutions): 2 x output elements x contracted size;
  elementwise ops 1 FLOP per element (transcendentals counted apart), reduces 1 per input element.
- custom calls (Mosaic / Pallas kernels): their `cost_estimate` (flops, bytes_accessed) from the
  backend config; the caller's `kernel_cost(name, operands, results, estimate)` may cost it instead
  (the splash attention kernels report none; the grouped matmuls' estimates count their worst-case
  buffers). A kernel left without a cost is listed in `uncosted` (name -> runs).
- collectives (all-gather, reduce-scatter, all-reduce, all-to-all incl. ragged, collective-permute;
  sync or the `-start` of the async pair; XLA:TPU's reduce-scatter is an `all-reduce-scatter` fusion
  of an all-reduce and a slice): bytes of the shard each chip contributes (operands; for
  all-gather the gathered result) x runs, and the ring traffic each chip sends: (n-1)/n of the
  full buffer for gather / scatter / all-to-all, 2(n-1)/n for all-reduce, all of it for a permute,
  n the replica group size. A ragged all-to-all counts the smaller of its send and receive buffers
  (the MoE dispatch sends every row of its [n k, D] side; the other side is the worst-case buffer).

With `breakdown=True` every HBM byte is also booked to a category (`train.hlo_breakdown`: MoE,
GDN, attention, CE, ... from the instructions' source stack frames), summing to the total.

The numbers are per device (an SPMD module is one device's program).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["COLLECTIVE_KINDS", "HloCost", "Instr", "Shape", "analyze", "parse_module"]

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
                "token": 0}
COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COLLECTIVE_OPS = {"all-gather": "all-gather", "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter",
                   "all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "all-to-all": "all-to-all",
                   "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
                   "collective-permute-start": "collective-permute"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sqrt", "rsqrt",
                   "cbrt", "sine", "cosine", "tan", "atan2", "power", "erf"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "sign", "compare",
                "select", "clamp", "and", "or", "xor", "not", "remainder", "floor", "ceil", "round-nearest-even",
                "round-nearest-afz", "shift-left", "shift-right-logical", "shift-right-arithmetic", "is-finite"}
# no HBM traffic of their own (views, bookkeeping, or loops whose bodies are counted instead)
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "partition-id", "replica-id", "opt-barrier", "iota", "call-start", "call-done",
             "async-start", "async-done", "async-update", "copy-start", "copy-done", "slice-done"}


@dataclass(frozen=True)
class Shape:
    """One array of an HLO type: element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> float:
        return _DTYPE_BYTES.get(self.dtype, 4) * math.prod(self.dims)

    @property
    def elements(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: `name = results opcode(operands), attrs`."""

    name: str
    opcode: str
    results: tuple[Shape, ...]  # the arrays of the result type (a tuple type: several)
    operands: tuple[str, ...]
    attrs: str


@dataclass
class HloCost:
    """Totals for one run of the module on one device. `kernels`: custom-call kernel name (the
    instruction name without its numeric suffix) -> [runs, FLOPs counted]. `uncosted`: kernels
    without a cost estimate (nor a `kernel_cost` answer): name -> runs. `collective_bytes` /
    `ici_bytes`: by kind (COLLECTIVE_KINDS). `whiles`: (instruction, trip count, runs).
    `hbm_by_category`: HBM bytes per category (only with `analyze(..., breakdown=True)`; sums to
    `hbm_bytes`). `cond_spread`: per category of a `conditional` (or "all" without a breakdown),
    [bytes, FLOPs] by which its costliest branch, the one counted, exceeds its cheapest, x runs."""

    flops: float = 0.0
    dot_flops: float = 0.0  # of `flops`: dots and convolutions outside the kernels
    elementwise_flops: float = 0.0  # of `flops`: elementwise ops and reduces
    transcendentals: float = 0.0
    hbm_bytes: float = 0.0
    collective_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVE_KINDS, 0.0))
    ici_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COLLECTIVE_KINDS, 0.0))
    kernels: dict[str, list[float]] = field(default_factory=dict)
    uncosted: dict[str, float] = field(default_factory=dict)
    whiles: list[tuple[str, int, float]] = field(default_factory=list)
    unknown_trips: list[str] = field(default_factory=list)
    hbm_by_category: dict[str, float] = field(default_factory=dict)
    cond_spread: dict[str, list[float]] = field(default_factory=dict)

    def add(self, other: "HloCost", times: float = 1.0, fused: bool = False) -> None:
        """self += times * other (`fused`: FLOPs only, a fusion's inner ops touch no HBM)."""
        self.flops += times * other.flops
        self.dot_flops += times * other.dot_flops
        self.elementwise_flops += times * other.elementwise_flops
        self.transcendentals += times * other.transcendentals
        if not fused:
            self.hbm_bytes += times * other.hbm_bytes
            for k, v in other.hbm_by_category.items():
                self.hbm_by_category[k] = self.hbm_by_category.get(k, 0.0) + times * v
        for k in COLLECTIVE_KINDS:
            self.collective_bytes[k] += times * other.collective_bytes[k]
            self.ici_bytes[k] += times * other.ici_bytes[k]
        for k, (n, f) in other.kernels.items():
            cur = self.kernels.setdefault(k, [0.0, 0.0])
            cur[0] += times * n
            cur[1] += times * f
        for k, n in other.uncosted.items():
            self.uncosted[k] = self.uncosted.get(k, 0.0) + times * n
        self.whiles += [(w, t, times * r) for w, t, r in other.whiles]
        self.unknown_trips += [w for w in other.unknown_trips if w not in self.unknown_trips]
        for k, (b, f) in other.cond_spread.items():
            cur = self.cond_spread.setdefault(k, [0.0, 0.0])
            cur[0] += times * b
            cur[1] += times * f

    def hbm_at(self, share: float, category: str = "CE") -> float:
        """HBM bytes when the costlier branch of `category`'s conditionals runs in `share` of their
        runs (the cheaper one in the rest) instead of in all of them (`hbm_bytes`, the upper bound):
        e.g. the share of CE chunks holding loss tokens."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share {share} is not in [0, 1]")
        return self.hbm_bytes - (1.0 - share) * self.cond_spread.get(category, [0.0, 0.0])[0]

    def flops_at(self, share: float, category: str = "CE") -> float:
        """`flops` scaled as `hbm_at` scales the bytes."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share {share} is not in [0, 1]")
        return self.flops - (1.0 - share) * self.cond_spread.get(category, [0.0, 0.0])[1]

    def as_dict(self) -> dict:
        return {"flops": self.flops, "dot_flops": self.dot_flops, "elementwise_flops": self.elementwise_flops,
                "transcendentals": self.transcendentals, "hbm_bytes": self.hbm_bytes,
                "collective_bytes": dict(self.collective_bytes), "ici_bytes": dict(self.ici_bytes),
                "kernels": {k: {"runs": n, "flops": f} for k, (n, f) in sorted(self.kernels.items())},
                "hbm_by_category": dict(self.hbm_by_category),
                "cond_spread": {k: {"bytes": b, "flops": f} for k, (b, f) in sorted(self.cond_spread.items())},
                "uncosted_kernels": dict(sorted(self.uncosted.items())), "unknown_trip_whiles": list(self.unknown_trips)}


# ---------------------------------------------------------------------------------------------
# parsing
_ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", re.S)
_CLOSE = re.compile(r'^\}(, execution_thread="[^"]*")?\s*$')


def _shapes(type_text: str) -> tuple[Shape, ...]:
    """Arrays of an HLO type string (`bf16[8,128]{1,0:T(8,128)}` or a tuple of them)."""
    out = []
    for dt, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", type_text)):
        if dt in _DTYPE_BYTES or re.fullmatch(r"f8e\w+|[su]\d+|f\d+", dt):
            out.append(Shape(dt, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(out)


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] in "({["
        depth -= s[j] in ")}]"
        if depth == 0:
            return j + 1
    return len(s)


def _instr(name: str, rest: str) -> Instr | None:
    rest = re.sub(r"/\*[^*]*\*/", "", rest)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
        while rest.count("{", 0, end) > rest.count("}", 0, end):  # a layout with spaces
            end = rest.find(" ", end + 1)
            end = len(rest) if end < 0 else end
    type_text, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([a-z][\w\-]*)\(", tail)
    if m is None:
        return None
    close = _balanced(tail, m.end() - 1)
    operands = tuple(o.strip().split(" ")[-1].lstrip("%") for o in _split_top(tail[m.end():close - 1]))
    return Instr(name, m.group(1), _shapes(type_text), tuple(o for o in operands if o), tail[close:])


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """(computation name -> instructions in order, name of the ENTRY computation). An instruction
    may span lines (a kernel's backend config can hold newlines): lines that start neither an
    instruction nor a computation, nor close one, continue the previous instruction."""
    raw: dict[str, list[list[str]]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h:
                cur = h.group(2)
                raw[cur] = []
                entry = cur if h.group(1) else entry
            continue
        if _CLOSE.match(line):
            cur = None
        elif _INSTR.match(line):
            raw[cur].append([line])
        elif raw[cur]:
            raw[cur][-1].append(line)
    if not entry:
        raise ValueError("HLO text has no ENTRY computation")
    comps: dict[str, list[Instr]] = {}
    for name, lines in raw.items():
        comps[name] = []
        for parts in lines:
            m = _INSTR.match("\n".join(parts))
            ins = _instr(m.group(1), m.group(2)) if m else None
            if ins is not None:
                comps[name].append(ins)
    return comps, entry


# ---------------------------------------------------------------------------------------------
def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(%?[\w.\-]+)", attrs)
    return m.group(1).lstrip("%") if m else None


def _group_size(attrs: str) -> int:
    """Devices per replica group: `{{0,1},{2,3}}`, iota `[2,2]<=[4]`, or `mesh[...] {'axis'}`."""
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip("' "))
    return 1


def _dot_flops(ins: Instr, shape_of: Callable[[str], tuple[Shape, ...]]) -> float:
    out = sum(s.elements for s in ins.results)
    if ins.opcode == "dot":
        lhs = shape_of(ins.operands[0])
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        k = math.prod(lhs[0].dims[int(d)] for d in m.group(1).split(",") if d) if (m and lhs) else 1
        return 2.0 * out * k
    # convolution: each output element contracts over the kernel's input features and the window
    # taps that land on the input (not on padding): TPU writes a head-batched matmul as a window
    # over a size-1 spatial dim, of which one tap per output is real
    rhs = shape_of(ins.operands[1]) if len(ins.operands) > 1 else ()
    lhs = shape_of(ins.operands[0])
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not rhs or not lhs or not labels or "i" not in labels.group(2):
        return 2.0 * out
    lhs_l, rhs_l, out_l = labels.groups()
    k = rhs[0].dims[rhs_l.index("i")]
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    sizes = re.search(r"size=([0-9x]+)", window.group(1)) if window else None
    pads = re.search(r"pad=([0-9_x\-]+)", window.group(1)) if window else None
    strides = re.search(r"stride=([0-9x]+)", window.group(1)) if window else None
    for d in sorted(c for c in rhs_l if c.isdigit()):
        j = int(d)
        w = int(sizes.group(1).split("x")[j]) if sizes else rhs[0].dims[rhs_l.index(d)]
        lo = int(pads.group(1).split("x")[j].split("_")[0]) if pads else 0
        st = int(strides.group(1).split("x")[j]) if strides else 1
        n_in, n_out = lhs[0].dims[lhs_l.index(d)], ins.results[0].dims[out_l.index(d)]
        o = np.arange(n_out) * st - lo  # input index of tap 0 for each output
        taps = np.clip(np.minimum(w, n_in - o), 0, None) - np.clip(-o, 0, None)
        k *= float(np.clip(taps, 0, None).sum()) / max(n_out, 1)
    return 2.0 * out * k


def _kernel_name(name: str) -> str:
    return re.sub(r"(\.\d+)+$", "", name)


def _cost_estimate(attrs: str) -> tuple[float, float] | None:
    m = re.search(r'"cost_estimate":\{([^}]*)\}', attrs)
    if not m:
        return None
    est = json.loads("{" + m.group(1) + "}")
    return float(est.get("flops", 0)), float(est.get("bytes_accessed", 0))


#: (kernel name, operand arrays, result arrays, its own (flops, bytes) estimate or None) -> the
#: (flops, bytes) to count, or None to keep the estimate
KernelCost = Callable[[str, tuple[Shape, ...], tuple[Shape, ...], "tuple[float, float] | None"],
                      "tuple[float, float] | None"]


#: ops whose result holds its first operand's elements (or a superset: pad) element for element: a
#: slice of the result reads only the matching part of the operand
_PASS_THROUGH = ("pad", "convert", "bitcast", "reshape", "copy")


class _Walker:
    def __init__(self, comps: dict[str, list[Instr]], kernel_cost: KernelCost | None,
                 categorize: Callable[[Instr], str] | None = None):
        self.comps, self.kernel_cost, self.categorize = comps, kernel_cost, categorize
        self.memo: dict[str, HloCost] = {}
        self.fusion_io: dict[str, tuple[dict[int, float], float | None]] = {}
        self.shapes = {c: {i.name: i.results for i in ins} for c, ins in comps.items()}
        self.by_name = {c: {i.name: i for i in ins} for c, ins in comps.items()}

    def cost(self, comp: str) -> HloCost:
        if comp not in self.memo:
            self.memo[comp] = HloCost()  # guards recursion
            total = HloCost()
            for ins in self.comps.get(comp, []):
                self._instr(comp, ins, total)
            self.memo[comp] = total
        return self.memo[comp]

    def _instr(self, comp: str, ins: Instr, total: HloCost) -> None:
        # XLA:TPU writes a reduce-scatter as a fusion `all-reduce-scatter*` of an all-reduce and the
        # slice each device keeps
        self.in_reduce_scatter = comp.startswith("all-reduce-scatter")
        shape_of = lambda n: self.shapes[comp].get(n, ())  # noqa: E731
        op = ins.opcode
        operand_bytes = sum(s.bytes for o in ins.operands for s in shape_of(o))
        result_bytes = sum(s.bytes for s in ins.results)
        out_elems = sum(s.elements for s in ins.results)
        if op == "fusion":
            self._book(ins, total, self._fusion_bytes(ins, shape_of))
        elif op in ("dynamic-slice", "slice"):
            self._book(ins, total, 2 * result_bytes)  # reads only the slice
        elif op == "slice-start":  # async slice ((operand), slice, context): reads and writes the slice
            self._book(ins, total, 2 * (ins.results[-2].bytes if len(ins.results) >= 2 else 0.0))
        elif op == "dynamic-update-slice":
            self._book(ins, total, 2 * sum(s.bytes for s in shape_of(ins.operands[1])))  # in place
        elif op not in _NO_BYTES and op != "custom-call":
            self._book(ins, total, operand_bytes + result_bytes)
        if op == "while":
            body, cond = _attr(ins.attrs, "body"), _attr(ins.attrs, "condition")
            trips = self._trip_count(comp, ins, body, cond)
            if trips is None:
                total.unknown_trips.append(ins.name)
                trips = 1
            total.whiles.append((ins.name, trips, 1.0))
            total.add(self.cost(body), trips)
            total.add(self.cost(cond), trips)
        elif op == "fusion":
            total.add(self.cost(_attr(ins.attrs, "calls")), fused=True)
        elif op in ("call", "call-start", "async-start"):
            callee = _attr(ins.attrs, "to_apply") or _attr(ins.attrs, "calls")
            if callee:
                total.add(self.cost(callee))
        elif op == "conditional":
            m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
            names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                     [n for n in (_attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation")) if n])
            if names:
                branches = sorted((self.cost(n) for n in names), key=lambda c: c.flops)
                total.add(branches[-1])
                spread = total.cond_spread.setdefault(self.categorize(ins) if self.categorize else "all", [0.0, 0.0])
                spread[0] += branches[-1].hbm_bytes - branches[0].hbm_bytes
                spread[1] += branches[-1].flops - branches[0].flops
        elif op in ("dot", "convolution"):
            f = _dot_flops(ins, shape_of)
            total.flops += f
            total.dot_flops += f
        elif op == "custom-call":
            self._custom_call(ins, shape_of, operand_bytes + result_bytes, total)
        elif op in _COLLECTIVE_OPS:
            self._collective(ins, shape_of, total)
        elif op in _TRANSCENDENTAL:
            total.transcendentals += out_elems
        elif op in _ELEMENTWISE or op in ("reduce", "reduce-window"):
            n = out_elems if op in _ELEMENTWISE else \
                sum(s.elements for o in ins.operands[: max(len(ins.operands) // 2, 1)] for s in shape_of(o))
            total.flops += n
            total.elementwise_flops += n

    def _book(self, ins: Instr, total: HloCost, nbytes: float) -> None:
        """`nbytes` of HBM traffic by `ins`: to the total and, with a breakdown, to its category."""
        total.hbm_bytes += nbytes
        if self.categorize is not None and nbytes:
            cat = self.categorize(ins)
            total.hbm_by_category[cat] = total.hbm_by_category.get(cat, 0.0) + nbytes

    def _fusion_bytes(self, ins: Instr, shape_of) -> float:
        """HBM bytes of a fusion: each operand read whole, except one only sliced inside (the slices'
        bytes: a layer's weights out of the stacked scan operand) or updated in place by a
        dynamic-update-slice root (then the result writes only the update)."""
        callee = _attr(ins.attrs, "calls")
        if callee not in self.fusion_io:
            body = self.comps.get(callee, [])
            params = {i.name: int(i.operands[0]) for i in body if i.opcode == "parameter" and i.operands
                      and i.operands[0].isdigit()}
            users: dict[str, list[Instr]] = {}
            for i in body:
                for o in i.operands:
                    users.setdefault(o, []).append(i)
            read: dict[int, float] = {}
            for name, idx in params.items():
                part = self._sliced_read(callee, name, users)
                if part is not None:
                    read[idx] = part
            write = None
            root = body[-1] if body else None
            if root is not None and root.opcode == "dynamic-update-slice" and root.operands[0] in params:
                read[params[root.operands[0]]] = 0.0
                upd = self.by_name[callee].get(root.operands[1])
                write = sum(r.bytes for r in upd.results) if upd is not None else None
            self.fusion_io[callee] = (read, write)
        read, write = self.fusion_io[callee]
        total = sum(read.get(i, sum(s.bytes for s in shape_of(o))) for i, o in enumerate(ins.operands))
        return total + (sum(r.bytes for r in ins.results) if write is None else write)

    def _sliced_read(self, comp: str, name: str, users: dict[str, list[Instr]] | None = None) -> float | None:
        """Bytes read of value `name` of fused computation `comp` when every use only slices it
        (directly or inside a nested fusion), else None (read whole)."""
        if users is None:
            users = {}
            for i in self.comps.get(comp, []):
                for o in i.operands:
                    users.setdefault(o, []).append(i)
        total = 0.0
        for u in users.get(name, []):
            if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
                total += sum(r.bytes for r in u.results)
            elif u.opcode in _PASS_THROUGH and u.operands[0] == name and len(u.results) == 1:
                # a value only sliced after a pad / convert / bitcast / reshape / copy reads what the
                # slices cover, in its own element type (a pad's added elements read nothing)
                part = self._sliced_read(comp, u.name, users)
                src = self.shapes[comp].get(name, ())
                if part is None or len(src) != 1:
                    return None
                (s_in,), (s_out,) = src, u.results
                per_in, per_out = s_in.bytes / max(s_in.elements, 1), s_out.bytes / max(s_out.elements, 1)
                total += min(part * per_in / per_out, s_in.bytes)
            elif u.opcode == "fusion":
                inner = _attr(u.attrs, "calls")
                params = {int(i.operands[0]): i.name for i in self.comps.get(inner, [])
                          if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()}
                for j, o in enumerate(u.operands):
                    if o == name:
                        part = self._sliced_read(inner, params.get(j, ""))
                        if part is None:
                            return None
                        total += part
            else:
                return None
        return total if users.get(name) else None

    def _custom_call(self, ins: Instr, shape_of, io_bytes: float, total: HloCost) -> None:
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        if target is None or target.group(1) != "tpu_custom_call":
            # Allocate*/Assume*/Prepare*: bookkeeping; ConcatBitcast: adjacent buffers viewed as one
            if target is None or not target.group(1).startswith(("Allocate", "Assume", "Prepare", "ConcatBitcast")):
                self._book(ins, total, io_bytes)
            return
        name = _kernel_name(ins.name)
        est = _cost_estimate(ins.attrs)
        if self.kernel_cost is not None:
            mine = self.kernel_cost(name, tuple(s for o in ins.operands for s in shape_of(o)), ins.results, est)
            est = est if mine is None else mine
        if est is None:
            total.uncosted[name] = total.uncosted.get(name, 0.0) + 1
            self._book(ins, total, io_bytes)
            return
        flops, nbytes = est
        total.flops += flops
        self._book(ins, total, nbytes)
        cur = total.kernels.setdefault(name, [0.0, 0.0])
        cur[0] += 1
        cur[1] += flops

    def _collective(self, ins: Instr, shape_of, total: HloCost) -> None:
        kind, n = _COLLECTIVE_OPS[ins.opcode], _group_size(ins.attrs)
        if kind == "all-reduce" and self.in_reduce_scatter:
            kind = "reduce-scatter"
        if ins.opcode == "ragged-all-to-all":  # the smaller of the send and the receive buffer
            size = min(sum(s.bytes for s in shape_of(o)) for o in ins.operands[:2])
        else:
            data = [o for o in ins.operands if shape_of(o)]
            size = sum(s.bytes for o in data for s in shape_of(o))
        if kind == "all-gather":
            size *= n  # the gathered result
        ring = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n) if n else 0.0
        total.collective_bytes[kind] += size
        total.ici_bytes[kind] += size * ring

    # -- trip counts
    def _const(self, comp: str, name: str) -> int | None:
        ins = self.by_name[comp].get(name)
        while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
            ins = self.by_name[comp].get(ins.operands[0])
        if ins is None or ins.opcode != "constant":
            return None
        m = re.match(r"\s*(-?\d+)", ins.operands[0] if ins.operands else "")  # constant(7)
        return int(m.group(1)) if m else None

    def _trip_count(self, comp: str, ins: Instr, body: str | None, cond: str | None) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        if m:
            return int(m.group(1))
        if not cond or cond not in self.comps or not self.comps[cond]:
            return None
        root = self.comps[cond][-1]
        if root.opcode != "compare" or len(root.operands) != 2:
            return None
        direction = re.search(r"direction=(\w+)", root.attrs)
        a, b = (self.by_name[cond].get(o) for o in root.operands)
        if a is None or b is None:
            return None
        if a.opcode == "constant":  # N > i  ==  i < N
            a, b = b, a
            flip = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}
            d = flip.get(direction.group(1), direction.group(1)) if direction else None
        else:
            d = direction.group(1) if direction else None
        if a.opcode != "get-tuple-element" or b.opcode != "constant":
            return None
        limit = self._const(cond, b.name)
        idx = int(_attr(a.attrs, "index") or 0)
        start = 0
        init = self.by_name[comp].get(ins.operands[0]) if ins.operands else None
        if init is not None and init.opcode == "tuple" and idx < len(init.operands):
            start = self._const(comp, init.operands[idx]) or 0
        step = self._step(body, idx) or 1
        if limit is None or d not in ("LT", "LE", "NE"):
            return None
        span = limit - start + (1 if d == "LE" else 0)
        return max(0, -(-span // step))

    def _step(self, body: str | None, idx: int) -> int | None:
        if not body or body not in self.comps or not self.comps[body]:
            return None
        root = self.comps[body][-1]
        if root.opcode != "tuple" or idx >= len(root.operands):
            return None
        upd = self.by_name[body].get(root.operands[idx])
        if upd is None or upd.opcode != "add":
            return None
        for o in upd.operands:
            c = self._const(body, o)
            if c is not None:
                return c
        return None


def analyze(text: str, kernel_cost: KernelCost | None = None, breakdown: bool = False) -> HloCost:
    """Cost of one run of the module in `text` (`compiled.as_text()`), per device. `kernel_cost`: see
    `KernelCost` (costs the Pallas kernels: those without an estimate, or re-costs one).
    `breakdown`: also book the HBM bytes per category (`HloCost.hbm_by_category`,
    `train.hlo_breakdown`) and key `cond_spread` by category."""
    comps, entry = parse_module(text)
    categorize = None
    if breakdown:
        from .hlo_breakdown import Categorizer

        categorize = Categorizer(text, comps)
    return _Walker(comps, kernel_cost, categorize).cost(entry)
