"""The recipe's initial weights and fresh train state (`SFTSetup.init_state`), streamed into the mesh.

`init_state(setup)` for an HF dir or an Orbax params checkpoint (`stream_params`):

1. every global tensor (embedding, final norm, lm_head) is read alone and put on the mesh in its
   target sharding (`sharding.put`: each process materialises only its addressable shards), then
   dropped on the host;
2. every stacked layer leaf is allocated on the mesh (zeros, in its target sharding and dtype), and
   filled one decoder layer at a time: the converted host layer (HF) or the layer restored straight
   into the layer-slice sharding (Orbax: each host reads only the chunks of its shards) goes on the
   mesh, and a jitted, donated `dynamic_update_index_in_dim` writes it into the stacked leaves in
   place, casting to the param dtype there;
3. the train state is built on the devices from those arrays (`init_train_state` with the state
   shardings, the params donated: no host round trip, no second device copy).

So a host holds at most one converted layer or one global tensor besides its shards of the params,
never the whole tree. The values are those of `load_params` (the whole tree on the host: the
reference, and the random init) cast to the param dtype, bit for bit; the Clover params an AR
checkpoint lacks start at the values `_fill_clover_params` gives them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from clover_jax.config import ModelConfig
from clover_jax.model.clover_model import (abstract_model, create_model, model_from_params, model_to_params,
                                           param_dtype_of)
from clover_jax.model.params import flatten, global_param_shapes, layer_param_shapes, stack_layers, unflatten
from clover_jax.parallel import sharding as sh
from clover_jax.yaml_config import ConfigError, to_tree
from clover_jax.model import lora
from sft.lora import frozen_dtype

log = logging.getLogger(__name__)

Flat = dict[str, Any]

__all__ = ["init_state", "init_state_host", "load_params", "param_targets", "stream_params"]


# ----------------------------------------------------------------------------------------------
# the whole tree on the host (reference; random init)
def _fill_clover_params(mcfg: ModelConfig, flat: Flat, target: dict[str, tuple[int, ...]] | None = None,
                        where: str = "") -> Flat:
    """An AR Orbax checkpoint into block mode: the Clover params at their init values (scalars
    (alpha, beta, gamma) per head, zero right-conv taps); anything else missing is an error.
    `target`: flat key -> shape of what is wanted (default: the whole stacked model of `mcfg`);
    `where` prefixes the keys in messages (e.g. ``layers.3.``)."""
    if target is None:
        target = {k: tuple(v.shape) for k, v in flatten(model_to_params(abstract_model(mcfg))).items()}
    out = dict(flat)
    filled = []
    for k, shape in target.items():
        if k in out:
            continue
        if k.endswith("bd_gdn_softmax_scalars"):
            out[k] = np.broadcast_to(np.asarray(mcfg.bd_scalar_init, np.float32), shape).copy()
        elif k.endswith(".right"):
            out[k] = np.zeros(shape, np.float32)
        else:
            raise ConfigError(f"model.init_from: checkpoint has no param {where + k!r}")
        filled.append(k)
    if filled:
        log.log(logging.DEBUG if where else logging.INFO,
                "block mode on an AR checkpoint: %d Clover params %sstart at their init values", len(filled), where)
    return out


def _hf_runtime(mcfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig overrides an HF dir is read with: all of `mcfg` but mode (block) and dtypes
    (both the param dtype, as `clover_jax.api.load_hf` sets them)."""
    name = jnp.dtype(mcfg.param_dtype).name
    tree = {k: tuple(v) if isinstance(v, list) else v for k, v in to_tree(mcfg).items()
            if k not in ("dtype", "param_dtype", "mode")}
    return {**tree, "dtype": name, "param_dtype": name}


def _adapter_key(seed: int) -> jax.Array:
    # the adapters of a run that starts from a checkpoint: `model.seed`, apart from other draws
    return jax.random.fold_in(jax.random.key(seed), 0x10AA)


def load_params(kind: str, path: Path | None, mcfg: ModelConfig, seed: int) -> dict[str, Any]:
    """Initial params (stacked pure dict, host or default device) in `mcfg.param_dtype`: the whole
    tree in memory. The random init's path; for checkpoints the reference `stream_params` equals.
    With LoRA (`mcfg.lora_rank`) a checkpoint's params gain fresh adapters (`lora.init_adapters`)."""
    if kind != "random" and mcfg.lora_rank:
        base = flatten(load_params(kind, path, lora.base_config(mcfg), seed))
        shapes = {k: tuple(v.shape) for k, v in flatten(model_to_params(abstract_model(mcfg))).items()}
        return unflatten({**base, **lora.init_adapters(shapes, _adapter_key(seed))})
    if kind == "random":
        return model_to_params(create_model(mcfg, seed))
    if kind == "hf":
        from clover_jax.api import load_hf

        runtime = _hf_runtime(mcfg)
        del runtime["dtype"], runtime["param_dtype"]
        _, model = load_hf(path, dtype=jnp.dtype(mcfg.param_dtype), mode="block", **runtime)
        return model_to_params(model)
    from clover_jax.bridge.params_checkpoint import load_params_checkpoint

    ck_cfg, tree = load_params_checkpoint(path)
    flat = _fill_clover_params(mcfg, flatten(stack_layers(ck_cfg, tree)))
    return model_to_params(model_from_params(mcfg, unflatten(flat)))


def init_state_host(setup: Any) -> Any:
    """The train state from `load_params` fetched whole to the host, then sharded by
    `init_train_state`: the random init's path, and the reference of `init_state`."""
    from train.state import init_train_state

    params = jax.device_get(load_params(setup.kind, setup.init_path, setup.model_cfg, setup.cfg.model.seed))
    return init_train_state(params, setup.optimizer, seed=setup.cfg.train.seed,
                            master_dtype=setup.cfg.train.param_dtype, frozen_dtype=frozen_dtype(setup.model_cfg),
                            out_shardings=setup.state_shardings)


# ----------------------------------------------------------------------------------------------
# streamed into the target sharding
def _layer_sharding(s: NamedSharding, key: str) -> NamedSharding:
    """The sharding of one layer's slice of a stacked leaf: its spec without the layer axis (the rule
    table never shards that axis: ``layers -> ()``, so every process holds all layers of its shard)."""
    spec = tuple(s.spec)
    if spec and spec[0] is not None:
        raise ValueError(f"param {key!r} is sharded over its layer axis ({s.spec}): it cannot be filled per layer")
    return NamedSharding(s.mesh, P(*spec[1:]))


def _check_item(got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], where: str,
                missing_ok: bool = False) -> None:
    """`got` (flat key -> shape, as read) against `want`: no extra key, no shape mismatch, and (unless
    `missing_ok`: filled in later) nothing missing; else a ConfigError naming `where` and the key."""
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError(f"model.init_from: {where} has params the model does not: {extra[:5]}")
    for k, shp in got.items():
        if tuple(shp) != tuple(want[k]):
            raise ConfigError(f"model.init_from: {where} param {k!r} has shape {tuple(shp)}, the model wants "
                              f"{tuple(want[k])}")
    missing = [k for k in want if k not in got]
    if missing and not missing_ok:
        raise ConfigError(f"model.init_from: {where} has no param {missing[0]!r}")


class _HFSource:
    """An HF dir read one global tensor / one converted layer at a time (`clover_jax.bridge.convert`,
    validated up front), as `load_hf` reads it (block mode: an AR dir's Clover params filled)."""

    def __init__(self, path: Path, mcfg: ModelConfig):
        from clover_jax.bridge import convert

        self.ck = convert.open_hf(path, mode="block", **_hf_runtime(mcfg))

    def globals(self, targets: Flat) -> Iterator[tuple[str, jax.Array]]:
        from clover_jax.bridge import hf_keys as hk

        ck = self.ck
        # a lazy iterator: each HF tensor is read when asked for and dropped before the next
        for key, host in hk.iter_hf_globals(ck.cfg, ck.layout, ck.index, source=str(ck.dir)):
            _check_item({key: host.shape}, {key: targets[key].shape} if key in targets else {}, str(ck.dir))
            yield key, sh.put(host, targets[key].sharding)
            del host

    def layer(self, i: int, targets: Flat) -> Flat:
        from clover_jax.bridge import hf_keys as hk

        ck = self.ck
        host = flatten(hk.hf_to_layer(ck.cfg, ck.layout, i, ck.index, source=str(ck.dir)))
        _check_item({k: v.shape for k, v in host.items()}, {k: t.shape for k, t in targets.items()},
                    f"{ck.dir} layer {i}")
        return {k: sh.put(host.pop(k), targets[k].sharding) for k in list(host)}


class _OrbaxSource:
    """An Orbax params checkpoint, each item restored straight into its target sharding (a version-1
    checkpoint, without the per-tensor manifest, is read on the host and put); the Clover params
    an AR checkpoint lacks are filled as `_fill_clover_params` does."""

    def __init__(self, path: Path, mcfg: ModelConfig):
        from clover_jax.bridge.params_checkpoint import open_params_checkpoint

        self.ck, self.mcfg = open_params_checkpoint(path), mcfg
        if self.ck.cfg.num_hidden_layers != mcfg.num_hidden_layers:
            raise ConfigError(f"model.init_from: {path} has {self.ck.cfg.num_hidden_layers} layers, the model "
                              f"{mcfg.num_hidden_layers}")

    def globals(self, targets: Flat) -> Iterator[tuple[str, jax.Array]]:
        ck = self.ck
        for key in ck.global_keys:
            if ck.sharded_reads:
                _check_item({key: ck.stored(key)[key][0]}, {key: targets[key].shape} if key in targets else {},
                            str(ck.dir))
                yield key, ck.read_global_sharded(key, targets[key].sharding)
            else:
                host = ck.read_global(key)
                _check_item({key: host.shape}, {key: targets[key].shape} if key in targets else {}, str(ck.dir))
                yield key, sh.put(host, targets[key].sharding)
                del host

    def layer(self, i: int, targets: Flat) -> Flat:
        ck, where = self.ck, f"{self.ck.dir} layer {i}"
        want = {k: t.shape for k, t in targets.items()}
        if ck.sharded_reads:
            stored = {k: s for k, (s, _) in ck.stored(i).items()}
            _check_item(stored, want, where, missing_ok=True)
            out = ck.read_layer_sharded(i, {k: targets[k].sharding for k in stored})
            host: Flat = {}
        else:
            host = flatten(ck.read_layer(i))
            _check_item({k: v.shape for k, v in host.items()}, want, where, missing_ok=True)
            out = {}
        # the Clover params of an AR checkpoint (tiny: per-head scalars, conv taps) on the host
        host = _fill_clover_params(self.mcfg, host, {k: want[k] for k in want if k not in out}, f"layers.{i}.")
        out.update({k: sh.put(host.pop(k), targets[k].sharding) for k in list(host)})
        return out


def _set_layer(stacked: Flat, layer: Flat, index: jax.Array) -> Flat:
    """`stacked[k][index] = layer[k]` cast to the stacked dtype, for every key (jitted with the
    stacked leaves donated: XLA updates them in place)."""
    return {k: lax.dynamic_update_index_in_dim(s, layer[k].astype(s.dtype), index, 0) for k, s in stacked.items()}


def _cast(x: jax.Array, t: jax.ShapeDtypeStruct) -> jax.Array:
    """`x` in `t`'s dtype (on the devices, in `t`'s sharding)."""
    if x.dtype == t.dtype:
        return x
    return jax.jit(lambda a: a.astype(t.dtype), out_shardings=t.sharding)(x)


def param_targets(mcfg: ModelConfig, shardings: Any) -> Flat:
    """Flat key -> `jax.ShapeDtypeStruct` of every stacked param: shape, the dtype `model_from_params`
    gives it, and its sharding from `shardings` (a pure dict like `model_to_params`)."""
    shard = flatten(shardings)
    return {k: jax.ShapeDtypeStruct(a.shape, param_dtype_of(mcfg, k, a.dtype), sharding=shard[k])
            for k, a in flatten(model_to_params(abstract_model(mcfg))).items()}


def stream_params(kind: str, path: Path, mcfg: ModelConfig, shardings: Any, seed: int = 0) -> Any:
    """The stacked params of the HF dir (``kind="hf"``) or Orbax params checkpoint (``"orbax"``) at
    `path` as global arrays in `shardings` (a pure dict like `model_to_params`, e.g.
    `SFTSetup.param_shardings`), read one global tensor / one layer at a time (module docstring).
    Every process must call it (the Orbax restores and the updates are collective)."""
    from clover_jax.bridge.params_checkpoint import bounded_host_memory, release_host_memory
    from train.optimizer import path_str

    if mcfg.lora_rank:  # the base model streamed in, then fresh adapters made in their shardings
        flat_sh = flatten(shardings)
        base = stream_params(kind, path, lora.base_config(mcfg),
                             unflatten({k: v for k, v in flat_sh.items() if not lora.is_adapter(k)}))
        shapes = {k: t.shape for k, t in param_targets(mcfg, shardings).items()}
        adapter_sh = {k: v for k, v in flat_sh.items() if lora.is_adapter(k)}
        adapters = jax.jit(lambda: lora.init_adapters(shapes, _adapter_key(seed)), out_shardings=adapter_sh)()
        every = {**flatten(base), **adapters}
        return jax.tree_util.tree_map_with_path(lambda kp, _: every[path_str(kp)], shardings)
    targets = param_targets(mcfg, shardings)
    src = _HFSource(path, mcfg) if kind == "hf" else _OrbaxSource(path, mcfg)
    p = mcfg.group_size
    out: Flat = {}
    with bounded_host_memory():  # chunk-sized read buffers go back to the OS at once
        g_want = {k: targets[k] for k in flatten(global_param_shapes(mcfg))}
        for key, arr in src.globals(g_want):
            out[key] = _cast(arr, g_want[key])
            del arr
            release_host_memory()
        _check_item({k: targets[k].shape for k in out}, {k: t.shape for k, t in g_want.items()}, str(path))
        for j in range(p):
            pre = f"groups.layer_{j}."
            group = {k[len(pre):]: t for k, t in targets.items() if k.startswith(pre)}
            shard = {k: t.sharding for k, t in group.items()}
            stacked = jax.jit(lambda g=group: {k: jnp.zeros(t.shape, t.dtype) for k, t in g.items()},
                              out_shardings=shard)()
            set_layer = jax.jit(_set_layer, donate_argnums=0, out_shardings=shard)
            slices = {k: jax.ShapeDtypeStruct(t.shape[1:], t.dtype, sharding=_layer_sharding(t.sharding, pre + k))
                      for k, t in group.items()}
            for gi in range(mcfg.num_groups):
                i = gi * p + j
                if set(flatten(layer_param_shapes(mcfg, i))) != set(slices):  # the stacking invariant
                    raise ValueError(f"layer {i} does not have the params of layer {j}")
                layer = src.layer(i, slices)
                stacked = set_layer(stacked, layer, np.int32(gi))
                del layer
                release_host_memory()
            out.update({pre + k: v for k, v in stacked.items()})
            del stacked
    return jax.tree_util.tree_map_with_path(lambda kp, _: out[path_str(kp)], shardings)


def init_state(setup: Any) -> Any:
    """The fresh train state of `setup` (an `SFTSetup`) on its mesh: a checkpoint streamed in
    (`stream_params`) and the state built from it on the devices, its params donated; the random
    init through the host (`init_state_host`)."""
    from train.state import init_train_state

    if setup.kind == "random":
        return init_state_host(setup)
    params = stream_params(setup.kind, setup.init_path, setup.model_cfg, setup.param_shardings, setup.cfg.model.seed)
    return init_train_state(params, setup.optimizer, seed=setup.cfg.train.seed,
                            master_dtype=setup.cfg.train.param_dtype, frozen_dtype=frozen_dtype(setup.model_cfg),
                            out_shardings=setup.state_shardings,
                            donate=True)
