"""Pure mapping between HF Qwen3.5/3.6-MoE text tensors and our per-layer param tree (numpy).

No file I/O here: `convert.py` streams tensors in and out, this module only checks and reshapes; the
names, layouts and per-tensor rules are in `hf_rules.py` (re-exported here). Every transform is a
transpose, a row split/concat or an expert stack/unstack, so values and dtypes pass through untouched
and HF -> ours -> HF is byte-identical (nothing is ever cast; only Clover tensors one side lacks are
made up, from the config's init values, see `hf_clover.py`).

HF side (docs/design.md 2.2; PyTorch [out, in]), with ``P`` the text prefix (``model.language_model.`` on
the hub, ``model.`` from ``save_pretrained``) and ``L = P + "layers.{i}."``:

=====================================================  ==========================  =====================
HF tensor                                              HF shape                    ours
=====================================================  ==========================  =====================
``P embed_tokens.weight``                              [V, D]                      embed.embedding [V, D]
``P norm.weight``                                      [D]                         final_norm.scale
``lm_head.weight`` (absent if tied)                    [V, D]                      lm_head.kernel [D, V]
``L input_layernorm`` / ``post_attention_layernorm``   [D]                         input_norm / post_norm
``L self_attn.{q,k,v,o}_proj.weight``                  [out, in]                   attn.*.kernel [in, out]
``L self_attn.{q,k}_norm.weight``                      [hd]                        attn.{q,k}_norm.scale
``L linear_attn.in_proj_qkv.weight``                   [2*nk*dk + nv*dv, D]        in_proj_{q,k,v} (rows q||k||v)
``L linear_attn.conv1d.weight``                        [C, 1, K]                   conv_{q,k,v} [K, part]
``L linear_attn.{in_proj_z,in_proj_b,in_proj_a,out_proj}.weight``                  [in, out]
``L linear_attn.{A_log,dt_bias}`` / ``norm.weight``    [nv] / [dv]                 gdn.A_log, dt_bias, norm.scale
``L mlp.gate.weight``                                  [E, D]                      moe.router.kernel [D, E]
``L mlp.experts.gate_up_proj`` (fused)                 [E, 2I, D] gate rows first  moe.wi_gate, wi_up [E, D, I]
``L mlp.experts.down_proj`` (fused)                    [E, D, I]                   moe.wo [E, I, D]
``L mlp.experts.{e}.{gate,up}_proj.weight`` (per exp)  [I, D]                      moe.wi_gate[e], wi_up[e]
``L mlp.experts.{e}.down_proj.weight`` (per expert)    [D, I]                      moe.wo[e]
``L mlp.shared_expert.{gate,up,down}_proj.weight``     [out, in]                   moe.shared_*_proj.kernel
``L mlp.shared_expert_gate.weight``                    [1, D]                      moe.shared_gate.kernel [D, 1]
``L linear_attn.<Clover scalars>`` (block mode)        [nv] x3 / [nv, 3]           gdn.bd_gdn_softmax_scalars [nv, 3]
``L linear_attn.<Clover right conv>`` (block mode)     [C, K-1]                    conv_{q,k,v}.right [K-1, part]
=====================================================  ==========================  =====================

The Clover rows exist on the HF side when `HFLayout.clover` (detected from the names on read; the
export format on write) and on ours when ``cfg.mode == "block"``; when only one side has them they
are dropped or filled with their init values (`hf_clover.py`: their names in the two public
namings, ``split`` and ``packed``, and the other shapes it accepts).

Streaming: `hf_to_layer` / `hf_to_globals` also take a `TensorSource` (a `SafetensorsIndex`)
instead of a dict, and then read each HF tensor in row blocks straight into C-contiguous outputs,
so an HF tensor and its transposed copy never coexist; `iter_layer_to_hf_blocks` /
`iter_globals_to_hf_blocks` go the other way one HF tensor at a time, each as an iterator of
C-contiguous row blocks (`ShardedSafetensorsWriter.write_rows`), so a transposed or concatenated
HF tensor is never materialised whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from typing import Any, Protocol, runtime_checkable

import numpy as np

from clover_jax.bridge import hf_clover as hc
from clover_jax.bridge.hf_rules import (  # re-exported: hf_keys is the public face of the HF mapping
    EXPERT_LAYOUTS, FUSED, HUB_PREFIX, LM_HEAD_KEY, PER_EXPERT, PLAIN_PREFIX, TEXT_PREFIXES, HFLayout,
    HFMappingError, Shape, Rule, all_expected_keys, check_hf_shapes, check_tensor_names, detect_layout,
    expected_hf_shapes, global_rules, layer_rules,
)
from clover_jax.config import ModelConfig
from clover_jax.model.params import check_flat_shapes, flatten, unflatten
from clover_jax.bridge.safetensors_io import row_blocks, rows_per_block, tiled_copy

logger = logging.getLogger(__name__)

Tree = dict[str, Any]

# --------------------------------------------------------------------------------------------
# HF -> ours
# --------------------------------------------------------------------------------------------


def _check_shape(key: str, arr: Any, expected: Shape, source: str) -> None:
    if tuple(arr.shape) != tuple(expected):
        raise HFMappingError(
            f"{source}: tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(expected)}"
        )


def _same_dtype(keys: Iterable[str], arrays: Iterable[Any]) -> np.dtype:
    pairs = list(zip(keys, arrays))
    dt = pairs[0][1].dtype
    for k, a in pairs[1:]:
        if a.dtype != dt:
            # concatenating would silently upcast and break the byte-exact round trip
            raise HFMappingError(
                f"{k!r} has dtype {a.dtype} but {pairs[0][0]!r} has {dt}; they share one HF tensor"
            )
    return dt


def _clover_to_ours(
    rule: Rule, get: Callable[[str], np.ndarray], shape_of: Callable[[str], Shape],
    dtype_of: Callable[[str], np.dtype], source: str,
) -> list[np.ndarray]:
    """Our leaves of a Clover rule (``[]`` if the model has none: the HF tensor is only checked)."""
    if rule.hf:
        for key in rule.hf:
            hc.check_shape(key, shape_of(key), rule.accepted_hf_shapes(), source)
        if not rule.ours:
            return []
        arrs = [np.asarray(get(key)) for key in rule.hf]
        nv = rule.our_shapes[0][0]
        if rule.kind == "bd_scalars" and len(arrs) > 1:
            return [hc.split_scalars_to_ours(rule.hf, arrs, nv, source)]
        if rule.kind == "bd_scalars":
            return [hc.scalars_to_ours(rule.hf[0], arrs[0], nv, rule.init, source)]
        return hc.right_to_ours(rule.hf[0], arrs[0], rule.our_shapes, source)
    if rule.kind == "bd_scalars":  # not in the checkpoint: init values
        return [hc.init_scalars(rule.our_shapes[0][0], rule.init)]
    return hc.init_right(rule.our_shapes, np.dtype(dtype_of(rule.like)))


def _apply_to_ours(rule: Rule, arrays: list[np.ndarray]) -> list[np.ndarray]:
    k = rule.kind
    if k == "copy":
        return arrays
    if k == "T":
        return [arrays[0].T]
    if k in ("rows", "conv"):
        a = arrays[0] if k == "rows" else arrays[0][:, 0, :]  # [C, D] or [C, K]
        out, start = [], 0
        for shape in rule.our_shapes:
            out.append(a[start:start + shape[1]].T)
            start += shape[1]
        return out
    if k == "gate_up":
        i = rule.our_shapes[0][2]
        a = arrays[0]
        return [a[:, :i, :].transpose(0, 2, 1), a[:, i:, :].transpose(0, 2, 1)]
    if k == "down":
        return [arrays[0].transpose(0, 2, 1)]
    if k == "experts":
        _same_dtype(rule.hf, arrays)
        return [np.stack([a.T for a in arrays])]
    raise AssertionError(k)


@runtime_checkable
class TensorSource(Protocol):
    """Where streaming conversion reads HF tensors from (`SafetensorsIndex` is one)."""

    def __contains__(self, key: object) -> bool: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> np.dtype: ...
    def get(self, key: str) -> np.ndarray: ...
    def get_rows(self, key: str, start: int, stop: int) -> np.ndarray: ...


def _is_source(tensors: Any) -> bool:
    return not isinstance(tensors, Mapping) and isinstance(tensors, TensorSource)


def _checked_keys(rule: Rule, src: TensorSource, source: str) -> np.dtype:
    """Checks presence and shape of a rule's HF tensors in ``src``; returns their (common) dtype."""
    for key, shape in zip(rule.hf, rule.hf_shapes()):
        if key not in src:
            raise HFMappingError(f"{source}: missing tensor {key!r}")
        got = tuple(src.shape(key))
        if got != tuple(shape):
            raise HFMappingError(f"{source}: tensor {key!r} has shape {got}, expected {tuple(shape)}")
    dts = [np.dtype(src.dtype(k)) for k in rule.hf]
    for k, dt in zip(rule.hf[1:], dts[1:]):
        if dt != dts[0]:
            raise HFMappingError(
                f"{k!r} has dtype {dt} but {rule.hf[0]!r} has {dts[0]}; they share one HF tensor"
            )
    return dts[0]


def _row_ranges(n_rows: int, shape: Shape, itemsize: int, max_bytes: int | None) -> Iterator[tuple[int, int]]:
    step = rows_per_block(shape, itemsize, max_bytes)
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def _fill_from_source(rule: Rule, src: TensorSource, source: str, max_bytes: int | None) -> list[np.ndarray]:
    """Our (C-contiguous) leaves of one rule, read from ``src`` in row blocks of ~``max_bytes``:
    peak memory is the outputs plus one block, never the HF tensor next to its transposed copy."""
    if rule.kind in ("bd_scalars", "bd_right"):  # small: read whole
        for key in rule.hf:
            if key not in src:
                raise HFMappingError(f"{source}: missing tensor {key!r}")
        return _clover_to_ours(rule, src.get, src.shape, src.dtype, source)
    dt = _checked_keys(rule, src, source)
    k, hf, hf_shape = rule.kind, rule.hf[0], rule.hf_shapes()[0]
    if k == "copy":
        return [src.get(hf)]  # a fresh contiguous array already
    outs = [np.empty(sh, dt) for sh in rule.our_shapes]
    if k == "T":  # HF [a, b] -> ours [b, a]
        (out,) = outs
        for r0, r1 in _row_ranges(hf_shape[0], hf_shape, dt.itemsize, max_bytes):
            tiled_copy(out[:, r0:r1].T, src.get_rows(hf, r0, r1))
    elif k == "rows":  # HF [sum parts, D] -> ours [D, part] each
        start = 0
        for out in outs:
            part = out.shape[1]
            for r0, r1 in _row_ranges(part, hf_shape, dt.itemsize, max_bytes):
                tiled_copy(out[:, r0:r1].T, src.get_rows(hf, start + r0, start + r1))
            start += part
    elif k == "conv":  # HF [C, 1, K] -> ours [K, part] each (small: read whole)
        a, start = src.get(hf), 0
        for out in outs:
            out[...] = a[start:start + out.shape[1], 0, :].T
            start += out.shape[1]
    elif k == "gate_up":  # HF [E, 2I, D] -> ours [E, D, I] x2, expert block by expert block
        gate, up = outs
        i = rule.our_shapes[0][2]
        for e0, e1 in _row_ranges(hf_shape[0], hf_shape, dt.itemsize, max_bytes):
            blk = src.get_rows(hf, e0, e1)
            tiled_copy(gate[e0:e1].transpose(0, 2, 1), blk[:, :i, :])
            tiled_copy(up[e0:e1].transpose(0, 2, 1), blk[:, i:, :])
            del blk
    elif k == "down":  # HF [E, D, I] -> ours [E, I, D]
        (out,) = outs
        for e0, e1 in _row_ranges(hf_shape[0], hf_shape, dt.itemsize, max_bytes):
            tiled_copy(out[e0:e1].transpose(0, 2, 1), src.get_rows(hf, e0, e1))
    elif k == "experts":  # E HF tensors [b, a] -> ours [E, a, b]
        (out,) = outs
        for e, key in enumerate(rule.hf):
            tiled_copy(out[e].T, src.get(key))
    else:
        raise AssertionError(k)
    return outs


def _iter_to_ours(
    rules: list[Rule], tensors: Mapping[str, np.ndarray] | TensorSource, source: str, max_bytes: int | None
) -> Iterator[tuple[str, np.ndarray]]:
    """(our flat key, leaf) rule by rule; a `TensorSource` is read only as each rule needs it."""
    stream = _is_source(tensors)
    for r in rules:
        if stream:
            yield from zip(r.ours, _fill_from_source(r, tensors, source, max_bytes))
            continue
        if r.kind in ("bd_scalars", "bd_right"):
            yield from zip(r.ours, _clover_to_ours(r, lambda k: _present(tensors, k, source),
                                                   lambda k: _present(tensors, k, source).shape,
                                                   lambda k: _present(tensors, k, source).dtype, source))
            continue
        arrays = []
        for key, shape in zip(r.hf, r.hf_shapes()):
            if key not in tensors:
                raise HFMappingError(f"{source}: missing tensor {key!r}")
            _check_shape(key, tensors[key], shape, source)
            arrays.append(np.asarray(tensors[key]))
        yield from zip(r.ours, _apply_to_ours(r, arrays))
        del arrays


def _present(tensors: Mapping[str, np.ndarray], key: str, source: str) -> Any:
    if key not in tensors:
        raise HFMappingError(f"{source}: missing tensor {key!r}")
    return tensors[key]


def _to_ours(
    rules: list[Rule], tensors: Mapping[str, np.ndarray] | TensorSource, source: str,
    max_bytes: int | None = None,
) -> Tree:
    return unflatten(dict(_iter_to_ours(rules, tensors, source, max_bytes)))


def hf_to_layer(
    cfg: ModelConfig, layout: HFLayout, i: int, tensors: Mapping[str, np.ndarray] | TensorSource, *,
    source: str = "checkpoint", max_block_bytes: int | None = None,
) -> Tree:
    """HF tensors of layer ``i`` (at least ``layer_rules(...)``'s keys) -> our per-layer dict.

    From a dict, leaves may be views of the HF arrays (transposes, row slices); from a
    `TensorSource` (e.g. a `SafetensorsIndex`), each leaf is a fresh C-contiguous array filled from
    row blocks of ~``max_block_bytes`` (default `safetensors_io.BLOCK_BYTES`), so peak memory is
    the layer plus one block. Dtypes are the source's either way.
    """
    return _to_ours(layer_rules(cfg, layout, i), tensors, source, max_block_bytes)


def hf_to_globals(
    cfg: ModelConfig, layout: HFLayout, tensors: Mapping[str, np.ndarray] | TensorSource, *,
    source: str = "checkpoint", max_block_bytes: int | None = None,
) -> Tree:
    """HF embedding / final norm / head -> ``{"embed", "final_norm", "lm_head"?}``."""
    return _to_ours(global_rules(cfg, layout), tensors, source, max_block_bytes)


def iter_hf_globals(
    cfg: ModelConfig, layout: HFLayout, tensors: Mapping[str, np.ndarray] | TensorSource, *,
    source: str = "checkpoint", max_block_bytes: int | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """``(flat key, leaf)`` of the globals one at a time (``"embed.embedding"``,
    ``"final_norm.scale"``, ``"lm_head.kernel"``): from a `TensorSource` each HF tensor is read only
    when its leaf is asked for, so a consumer that drops each leaf before the next holds one."""
    return _iter_to_ours(global_rules(cfg, layout), tensors, source, max_block_bytes)


# --------------------------------------------------------------------------------------------
# ours -> HF
# --------------------------------------------------------------------------------------------


def _our_leaves(rules: list[Rule], tree: Tree, where: str) -> dict[str, Any]:
    flat = flatten(tree)
    wanted = {k: sh for r in rules for k, sh in zip(r.ours, r.our_shapes)}
    check_flat_shapes(flat, wanted, where, HFMappingError, "params with no HF tensor:")
    return flat


def _gate_up_blocks(gate: np.ndarray, up: np.ndarray, max_bytes: int | None) -> Iterator[np.ndarray]:
    """HF ``gate_up_proj`` [E, 2I, D] (gate rows first) from ours [E, D, I] x2, a few experts at a time."""
    e, d, i = gate.shape
    n = rows_per_block((e, 2 * i, d), gate.itemsize, max_bytes)
    for e0 in range(0, e, n):
        e1 = min(e0 + n, e)
        out = np.empty((e1 - e0, 2 * i, d), gate.dtype)  # (np.concatenate would not be C-ordered)
        tiled_copy(out[:, :i, :], gate[e0:e1].transpose(0, 2, 1))
        tiled_copy(out[:, i:, :], up[e0:e1].transpose(0, 2, 1))
        yield out
        del out


def _hf_blocks(
    rule: Rule, arrays: list[np.ndarray], max_bytes: int | None, like: Callable[[str], Any] | None = None
) -> list[tuple[str, Iterator[np.ndarray]]]:
    """``[(hf_key, blocks)]`` of one rule: each HF tensor as lazy C-contiguous leading-axis blocks of
    ~``max_bytes`` (an already contiguous leaf is its own single block, uncopied). ``like(key)``
    gives the leaf whose dtype a filled-in Clover tensor takes."""
    k = rule.kind
    if k in ("bd_scalars", "bd_right"):
        if not rule.hf:
            return []  # the format has no such tensor: dropped
        if k == "bd_scalars":
            arr = arrays[0] if rule.ours else hc.init_scalars(rule.our_shapes[0][0], rule.init)
            parts = [arr] if len(rule.hf) == 1 else hc.scalars_to_split(np.asarray(arr))
            return [(key, row_blocks(a, max_bytes)) for key, a in zip(rule.hf, parts)]
        if rule.ours:
            _same_dtype(rule.ours, arrays)
            return [(rule.hf[0], chain.from_iterable(row_blocks(a.T, max_bytes) for a in arrays))]
        dt = np.dtype(np.asarray(like(rule.like)).dtype)
        return [(rule.hf[0], row_blocks(hc.right_to_hf(hc.init_right(rule.our_shapes, dt)), max_bytes))]
    if k == "copy":
        return [(rule.hf[0], row_blocks(arrays[0], max_bytes))]
    if k == "T":
        return [(rule.hf[0], row_blocks(arrays[0].T, max_bytes))]
    _same_dtype(rule.ours, arrays)
    if k == "rows":
        return [(rule.hf[0], chain.from_iterable(row_blocks(a.T, max_bytes) for a in arrays))]
    if k == "conv":
        return [(rule.hf[0], chain.from_iterable(row_blocks(a.T[:, None, :], max_bytes) for a in arrays))]
    if k == "gate_up":
        return [(rule.hf[0], _gate_up_blocks(arrays[0], arrays[1], max_bytes))]
    if k == "down":
        return [(rule.hf[0], row_blocks(arrays[0].transpose(0, 2, 1), max_bytes))]
    if k == "experts":
        return [(key, row_blocks(e.T, max_bytes)) for key, e in zip(rule.hf, arrays[0])]
    raise AssertionError(k)


def _assemble(shape: Shape, dtype: np.dtype | None, blocks: Iterable[np.ndarray]) -> np.ndarray:
    """One C-contiguous array from row blocks (a single whole block is returned as is); ``dtype``
    None = the blocks' own."""
    out, row = None, 0
    for b in blocks:
        if out is None:
            if b.shape == tuple(shape):
                return b
            out = np.empty(shape, dtype or b.dtype)
        out[row:row + b.shape[0]] = b
        row += b.shape[0]
    return out if out is not None else np.empty(shape, dtype)


def _iter_to_hf_blocks(
    rules: list[Rule], tree: Tree, where: str, max_bytes: int | None
) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    flat = _our_leaves(rules, tree, where)
    for r in rules:
        yield from _hf_blocks(r, [np.asarray(flat[k]) for k in r.ours], max_bytes, flat.__getitem__)


def _iter_to_hf(rules: list[Rule], tree: Tree, where: str) -> Iterator[tuple[str, np.ndarray]]:
    flat = _our_leaves(rules, tree, where)
    for r in rules:
        arrays = [np.asarray(flat[k]) for k in r.ours]
        for (key, blocks), shape in zip(_hf_blocks(r, arrays, None, flat.__getitem__), r.hf_shapes()):
            yield key, _assemble(shape, arrays[0].dtype if arrays else None, blocks)


def _to_hf(rules: list[Rule], tree: Tree, where: str) -> list[tuple[str, np.ndarray]]:
    return list(_iter_to_hf(rules, tree, where))


def layer_to_hf(cfg: ModelConfig, layout: HFLayout, i: int, layer: Tree) -> list[tuple[str, np.ndarray]]:
    """Our per-layer dict of layer ``i`` -> ordered ``[(hf_key, array)]`` (C-contiguous arrays)."""
    return _to_hf(layer_rules(cfg, layout, i), layer, f"layer {i}")


def iter_layer_to_hf(cfg: ModelConfig, layout: HFLayout, i: int, layer: Tree) -> Iterator[tuple[str, np.ndarray]]:
    """`layer_to_hf` one HF tensor at a time, so a streaming writer never holds a converted copy of
    the whole layer (the input layer is validated on the first ``next``)."""
    return _iter_to_hf(layer_rules(cfg, layout, i), layer, f"layer {i}")


def iter_layer_to_hf_blocks(
    cfg: ModelConfig, layout: HFLayout, i: int, layer: Tree, *, max_block_bytes: int | None = None
) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """``(hf_key, blocks)`` per HF tensor of layer ``i``, in `layer_hf_specs` order; ``blocks`` yields
    the tensor as consecutive C-contiguous leading-axis blocks of ~``max_block_bytes`` (default
    `safetensors_io.BLOCK_BYTES`; what `ShardedSafetensorsWriter.write_rows` takes), so a
    transposed / concatenated HF tensor never exists whole. Consume each ``blocks`` before the
    next ``next``."""
    return _iter_to_hf_blocks(layer_rules(cfg, layout, i), layer, f"layer {i}", max_block_bytes)


def globals_to_hf(cfg: ModelConfig, layout: HFLayout, globals_tree: Tree) -> list[tuple[str, np.ndarray]]:
    """Our globals (``embed``, ``final_norm``, ``lm_head``) -> ordered ``[(hf_key, array)]``."""
    return _to_hf(global_rules(cfg, layout), globals_tree, "globals")


def iter_globals_to_hf_blocks(
    cfg: ModelConfig, layout: HFLayout, globals_: Tree | Callable[[str], Any], *,
    max_block_bytes: int | None = None,
) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """`iter_layer_to_hf_blocks` for the globals. ``globals_`` is the globals tree, or a function
    ``flat key -> array`` (e.g. ``"lm_head.kernel"``) that is called for each leaf only when its HF
    tensor is next, and whose result is dropped once that tensor's blocks are consumed: with a
    checkpoint reader behind it, one global is in memory at a time."""
    rules = global_rules(cfg, layout)
    if not callable(globals_):
        yield from _iter_to_hf_blocks(rules, globals_, "globals", max_block_bytes)
        return
    for r in rules:
        arrays = []
        for key, shape in zip(r.ours, r.our_shapes):
            arrays.append(np.asarray(globals_(key)))
            if tuple(arrays[-1].shape) != shape:
                raise HFMappingError(
                    f"globals: param {key!r} has shape {tuple(arrays[-1].shape)}, expected {shape}"
                )
        yield from _hf_blocks(r, arrays, max_block_bytes)
        del arrays  # before the next global is read


def _specs(rules: list[Rule], dtypes: Mapping[str, Any], where: str) -> list[tuple[str, Shape, np.dtype]]:
    out = []
    for r in rules:
        if r.kind in ("bd_scalars", "bd_right") and r.hf and not r.ours:  # filled in on write
            dt = np.dtype(np.float32) if r.kind == "bd_scalars" else np.dtype(dtypes[r.like])
            out.extend((k, sh, dt) for k, sh in zip(r.hf, r.hf_shapes()))
            continue
        if not r.hf:  # dropped on write
            continue
        missing = [k for k in r.ours if k not in dtypes]
        if missing:
            raise HFMappingError(f"{where}: no dtype recorded for param {missing[0]!r}")
        dts = {np.dtype(dtypes[k]) for k in r.ours}
        if len(dts) > 1:
            raise HFMappingError(
                f"{where}: params {r.ours} share one HF tensor but have dtypes {sorted(map(str, dts))}"
            )
        dt = dts.pop()
        out.extend((k, sh, dt) for k, sh in zip(r.hf, r.hf_shapes()))
    return out


def layer_hf_specs(
    cfg: ModelConfig, layout: HFLayout, i: int, dtypes: Mapping[str, Any]
) -> list[tuple[str, Shape, np.dtype]]:
    """``[(hf_key, hf_shape, dtype)]`` that `layer_to_hf` will produce, from our flat-key dtypes
    (so a streaming writer can plan every shard before reading any data)."""
    return _specs(layer_rules(cfg, layout, i), dtypes, f"layer {i}")


def globals_hf_specs(
    cfg: ModelConfig, layout: HFLayout, dtypes: Mapping[str, Any]
) -> list[tuple[str, Shape, np.dtype]]:
    return _specs(global_rules(cfg, layout), dtypes, "globals")


__all__ = [
    "EXPERT_LAYOUTS", "FUSED", "HFLayout", "HFMappingError", "HUB_PREFIX", "LM_HEAD_KEY", "PER_EXPERT",
    "PLAIN_PREFIX", "TEXT_PREFIXES", "all_expected_keys", "check_hf_shapes", "check_tensor_names", "detect_layout",
    "TensorSource", "expected_hf_shapes", "global_rules", "globals_hf_specs", "globals_to_hf", "hf_to_globals",
    "hf_to_layer", "iter_globals_to_hf_blocks", "iter_hf_globals", "iter_layer_to_hf", "iter_layer_to_hf_blocks",
    "layer_hf_specs", "layer_rules", "layer_to_hf",
]
