"""Where a compiled step's HBM bytes go: each instruction of the optimized HLO booked to a category
from its source stack frames (`train.hlo_cost.analyze(..., breakdown=True)`, `launch.py compile
--breakdown`).

JAX records, for every op it lowers, the Python call stack of the user code that made it (XLA prints
the frames as tables at the top of the module text: FileNames, FunctionNames, FileLocations,
StackFrames; an instruction names its innermost frame by `stack_frame_id`). Fusions keep the
frames of the op they were built around, backward ops those of the forward op they transpose.
The category of an instruction is the first rule of `RULES` that a frame matches, walking from
the innermost frame outwards (so a projection inside the MoE books to the projections, the rest of
the MoE to the MoE), with these exceptions decided by the instruction itself:

- collectives (all-gather, reduce-scatter, all-reduce, all-to-all, permute: the buffers they read
  and write in HBM; their link traffic is `HloCost.ici_bytes`) -> "collectives (HBM side)";
- the grouped-matmul kernels (`kernel_costs.GROUPED_MATMUL_KERNELS`, also under a prefix such
  as `transpose_jvp_jit_tgmm___`) and the dots of the MoE
  (a dot, or a fusion holding one, booked to the MoE: the blocked / capacity / dense paths, and
  the CPU's expansion of `ragged_dot`) -> "MoE grouped matmuls";
- Pallas kernels of the GDN -> "GDN kernels".

An instruction without a frame matching a rule (embeddings, copies XLA inserted, the loss's
bookkeeping) goes to "norms / other".
"""

from __future__ import annotations

import re
from typing import Any

#: an HLO instruction of `train.hlo_cost` (its `Instr`; not imported: hlo_cost imports this module)
Instr = Any

__all__ = ["CATEGORIES", "RULES", "Categorizer", "stack_frames", "table"]

MOE_MATMULS, MOE_OTHER = "MoE grouped matmuls", "MoE other"
GDN_KERNELS, GDN_OTHER = "GDN kernels", "GDN other"
ATTENTION, CE, DENSE = "attention", "CE", "dense projections (and windowed-einsum loops)"
OTHER, COLLECTIVES, OPTIMIZER = "norms / other", "collectives (HBM side)", "optimizer"
#: every category, in the order the table prints them
CATEGORIES = (MOE_MATMULS, MOE_OTHER, GDN_KERNELS, GDN_OTHER, ATTENTION, CE, DENSE, OTHER, COLLECTIVES, OPTIMIZER)

#: (file path pattern, function name pattern or None = any, innermost frame only, category): the
#: first rule a frame matches, innermost frame first, decides. `train/step.py` only as the innermost
#: frame: every op of the step has it among its outer frames.
RULES: tuple[tuple[str, str | None, bool, str], ...] = (
    (r"(^|/)optax/|train/optimizer\.py", None, False, OPTIMIZER),
    (r"train/step\.py", None, True, OPTIMIZER),  # gradient accumulation, global norm, the update
    (r"sft/loss\.py", r"ce|chunk", False, CE),  # weighted_ce, _sharded_ce, _chunk_sweep, _ce_chunks
    (r"train/aot\.py", r"chunked_ce", False, CE),  # the stand-in step's CE
    (r"clover_jax/model/nn\.py", r"^Dense\.|low_rank", False, DENSE),
    (r"clover_jax/model/nn\.py", r"RMSNorm|rms_normalize", False, OTHER),
    (r"clover_jax/model/moe", None, False, MOE_OTHER),
    (r"clover_jax/model/gdn|pallas_kernels/gdn/|pallas_kernels/context/gdn", None, False, GDN_OTHER),
    (r"clover_jax/model/attention|pallas_kernels/attention/|pallas_kernels/context/(attention|splash)", None, False,
     ATTENTION),
)

_COLLECTIVE = re.compile(r"^(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute)"
                         r"(-start|-done)?$")
_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
#: kernel names of the grouped matmuls (XLA's ragged dot; megablox gmm / tgmm, possibly prefixed)
_GROUPED = re.compile(r"^ragged-dot-(?!metadata)|(^|_)t?gmm(_|$)")


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the module's header tables (`FileNames`, ...), [] when absent."""
    m = re.search(rf"^{name}\n(.*?)(?:\n\s*\n|\n(?=[A-Z]))", text, re.S | re.M)
    return m.group(1).splitlines() if m else []


def stack_frames(text: str) -> dict[int, list[tuple[str, str]]]:
    """Frame id -> its stack as (file, function) pairs, innermost first, from the module's tables.

    XLA prints each frame's parent one above its id (a frame whose parent is frame 6 says
    `parent_frame_id=7`, a root frame `1`); a table in which no frame names itself as its parent is
    taken as printed."""
    files = {int(i): f.strip('"') for i, f in (ln.split(None, 1) for ln in _table(text, "FileNames") if ln.strip())}
    funcs = {int(i): f.strip('"') for i, f in (ln.split(None, 1) for ln in _table(text, "FunctionNames") if ln.strip())}
    locs, parents = {}, {}
    for ln in _table(text, "FileLocations"):
        kv = dict(re.findall(r"(\w+)=(\d+)", ln))
        if ln.strip() and "file_name_id" in kv:
            locs[int(ln.split()[0])] = (files.get(int(kv["file_name_id"]), "?"),
                                        funcs.get(int(kv.get("function_name_id", 0)), "?"))
    raw = {}
    for ln in _table(text, "StackFrames"):
        kv = dict(re.findall(r"(\w+)=(\d+)", ln))
        if ln.strip() and "file_location_id" in kv:
            raw[int(ln.split()[0])] = (int(kv["file_location_id"]), int(kv.get("parent_frame_id", 0)))
    shift = 1 if any(p == i for i, (_, p) in raw.items()) else 0
    for i, (_, p) in raw.items():
        parents[i] = p - shift
    out: dict[int, list[tuple[str, str]]] = {}
    for i in raw:
        chain, j, seen = [], i, set()
        while j in raw and j not in seen:
            seen.add(j)
            chain.append(locs.get(raw[j][0], ("?", "?")))
            j = parents[j]
        out[i] = chain
    return out


class Categorizer:
    """`categorize(instruction) -> category` for one module (`text`, its parsed computations)."""

    def __init__(self, text: str, comps: dict[str, list[Instr]]):
        self.frames = stack_frames(text)
        self.comps = comps
        self.memo: dict[int, str] = {}
        self.has_dot: dict[str, bool] = {}
        self.rules = [(re.compile(f), re.compile(g) if g else None, inner, c) for f, g, inner, c in RULES]

    def _by_frames(self, frame: int) -> str:
        if frame not in self.memo:
            cat = OTHER
            for depth, (path, func) in enumerate(self.frames.get(frame, [])):
                hit = next((c for f, g, inner, c in self.rules
                            if f.search(path) and (g is None or g.search(func)) and (depth == 0 or not inner)), None)
                if hit is not None:
                    cat = hit
                    break
            self.memo[frame] = cat
        return self.memo[frame]

    def _holds_dot(self, comp: str | None) -> bool:
        if comp is None:
            return False
        if comp not in self.has_dot:
            self.has_dot[comp] = False  # guards recursion
            self.has_dot[comp] = any(i.opcode in ("dot", "convolution") or
                                     (i.opcode == "fusion" and self._holds_dot(_calls(i.attrs)))
                                     for i in self.comps.get(comp, []))
        return self.has_dot[comp]

    def __call__(self, ins: Instr) -> str:
        if _COLLECTIVE.match(ins.opcode) or (ins.opcode == "fusion" and "all-reduce-scatter" in (_calls(ins.attrs) or "")):
            return COLLECTIVES
        m = _FRAME_ID.search(ins.attrs)
        cat = self._by_frames(int(m.group(1))) if m else OTHER
        if ins.opcode == "custom-call":
            if _GROUPED.search(re.sub(r"(\.\d+)+$", "", ins.name)):
                return MOE_MATMULS
            if cat == GDN_OTHER and "tpu_custom_call" in ins.attrs:
                return GDN_KERNELS
        if cat == MOE_OTHER and (ins.opcode in ("dot", "convolution") or
                                 (ins.opcode == "fusion" and self._holds_dot(_calls(ins.attrs)))):
            return MOE_MATMULS
        return cat


def _calls(attrs: str) -> str | None:
    m = re.search(r"\bcalls=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def table(by_category: dict[str, float], total: float, runs_note: str = "") -> list[str]:
    """The breakdown as printed lines: GB per chip per step and share of `total`, per category."""
    lines = [f"  HBM bytes per chip per step by category (from the HLO's source stack frames){runs_note}:"]
    for cat in CATEGORIES + tuple(sorted(set(by_category) - set(CATEGORIES))):
        b = by_category.get(cat, 0.0)
        lines.append(f"    {cat:<48}{b / 1e9:>12,.1f} GB {100 * b / max(total, 1.0):>6.1f}%")
    return lines
