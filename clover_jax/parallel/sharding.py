"""Mesh, THE logical-axis rule table, and the helpers that turn logical names into shardings.

Model code names every dimension logically (`nn.make_param(..., logical_axes)` for parameters,
`constrain(x, ("batch", "length", "act_embed"))` for activations); this module alone maps those
names onto the mesh axes `("data", "fsdp", "expert", "context", "tensor")` (docs/design.md 4, the
MaxText pattern). `length -> context` splits every row's sequence into contiguous shards (context
parallelism, `pallas_kernels.context.split`); with `context: 1` (the default) nothing changes.

Resolution of one dimension (`logical_to_spec`): the rule's mesh axes, minus axes of size 1, minus
axes an earlier dimension of the same tensor already uses (so `batch` -> (data, fsdp, expert) and
`embed` -> fsdp never collide on an activation), and cut to the longest prefix whose size product
divides the dimension. A cut rule warns once per (name, rule, mesh) and never crashes: a dimension
nothing divides is replicated.

The current mesh + rules (read by `constrain` and by the expert-parallel MoE) are set only by the
`use_sharding(mesh, rules)` context manager; outside it everything is single-device and
`constrain` is a no-op. Enter it OUTSIDE `jax.jit`: a function traced without it keeps that trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

Rules = tuple[tuple[str, tuple[str, ...]], ...]

#: The one rule table: logical axis -> mesh axes (in order; () = replicated). Every logical name
#: the model uses must be listed (`logical_to_spec` rejects unknown names).
DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", ("context",)),  # contiguous sequence shards (context parallelism)
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_vocab", ("tensor",)),
    # parameters
    ("embed", ("fsdp", "context")),  # the context axis shards weights too (FSDP over both), as MaxText
    ("vocab", ("tensor",)),
    ("heads", ("tensor",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert_mlp", ("tensor",)),
    ("gdn_qk", ("tensor",)),
    ("gdn_v", ("tensor",)),
    ("gdn_heads", ("tensor",)),
    ("experts", ("expert",)),
    ("router_experts", ()),  # router kernel [D, E]: small, every token needs every logit
    ("layers", ()),
    ("conv_tap", ()),
    ("head_dim", ()),
    ("norm", ()),
    ("bd_scalar", ()),
    ("lora_rank", ("fsdp",)),  # LoRA rank dim: over fsdp where the factor's other dim is not (wi_gate's B [E, r, I])
)


# ---------------------------------------------------------------------------------------------
# mesh
@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1 (fills the remaining devices).

    `dcn_data` is how many slices (TPU multi-slice) or hosts (GPU multi-node) the `data` axis spans
    over the data-centre network; it must divide `data`. The other axes stay inside a slice.
    `context` splits every row's sequence into that many contiguous shards (see
    `pallas_kernels.context.split.check_context_split` for what the row length must satisfy).
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    dcn_data: int = 1

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        """{axis: size} with -1 resolved; errors name the field."""
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        for a, s in sizes.items():
            if s != -1 and s < 1:
                raise ValueError(f"mesh.{a} must be a positive size or -1, got {s}")
        if len(free) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {free}")
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if free:
            if num_devices % fixed:
                raise ValueError(f"mesh: {num_devices} devices do not split into the fixed axes "
                                 f"{ {a: s for a, s in sizes.items() if s != -1} } (product {fixed})")
            sizes[free[0]] = num_devices // fixed
        if math.prod(sizes.values()) != num_devices:
            raise ValueError(f"mesh: axis sizes {sizes} (product {math.prod(sizes.values())}) do not match "
                             f"{num_devices} devices")
        if self.dcn_data < 1 or sizes["data"] % self.dcn_data:
            raise ValueError(f"mesh.dcn_data={self.dcn_data} must be >= 1 and divide mesh.data={sizes['data']}")
        return sizes


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of names), as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def make_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all) with axes `MESH_AXES`.

    With `dcn_data > 1` the data axis is split into slices (TPU `slice_index`) or processes
    (everything else) so that only the data axis crosses the slow network.
    """
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.axis_sizes(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if cfg.dcn_data > 1:
        ici = (sizes["data"] // cfg.dcn_data,) + shape[1:]
        dcn = (cfg.dcn_data,) + (1,) * (len(MESH_AXES) - 1)
        # TPU multi-slice: devices carry distinct `slice_index`; elsewhere (GPU hosts, CPU
        # processes) every device reports one slice and the process is the DCN granule
        granule_is_process = len({getattr(d, "slice_index", None) for d in devices}) <= 1
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=granule_is_process,
                                                    allow_split_physical_axes=True)
    else:
        try:  # physical-topology aware order on TPU; a plain reshape where topology is unknown
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


# ---------------------------------------------------------------------------------------------
# logical -> physical
def rules_dict(rules: Rules | Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    items = rules.items() if isinstance(rules, Mapping) else rules
    return {name: tuple(axes) for name, axes in items}


def with_rules(rules: Rules, **changes: Sequence[str]) -> Rules:
    """A copy of `rules` with some names remapped (`with_rules(DEFAULT_RULES, experts=("fsdp",))`)."""
    d = rules_dict(rules)
    for name, axes in changes.items():
        if name not in d:
            raise ValueError(f"with_rules: unknown logical axis {name!r}")
        d[name] = tuple(axes)
    return tuple(d.items())


_WARNED: set[tuple[Any, ...]] = set()  # only de-duplicates warnings; holds no configuration


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules | Mapping[str, Sequence[str]], mesh: Mesh | Any,
    shape: Sequence[int] | None = None, *, what: str = "",
) -> P:
    """PartitionSpec for one tensor whose dims are named `axes` (see the module doc for the
    resolution order). `shape` enables the divisibility fallback; `what` names the tensor in errors."""
    table = rules_dict(rules)
    mesh_sizes = dict(mesh.shape)
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"{what or 'tensor'}: logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out: list[Any] = []
    for dim, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"{what or 'tensor'}: no sharding rule for logical axis {name!r} "
                             f"(known: {', '.join(sorted(table))})")
        cand = [a for a in table[name] if mesh_sizes.get(a, 1) > 1 and a not in used]
        keep, prod = [], 1
        for a in cand:
            if shape is not None and shape[dim] % (prod * mesh_sizes[a]):
                break
            keep.append(a)
            prod *= mesh_sizes[a]
        if len(keep) < len(cand):
            key = (name, tuple(table[name]), tuple(sorted(mesh_sizes.items())))
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(
                    f"sharding rule {name!r} -> {cand} does not divide dimension {shape[dim]} of "
                    f"{what or 'a tensor'} {tuple(shape)} on mesh {mesh_sizes}; using "
                    f"{keep or 'replication'} for it (warned once per rule and mesh)", stacklevel=2)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return P(*out)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES,
                   shape: Sequence[int] | None = None, *, what: str = "") -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape, what=what))


# ---------------------------------------------------------------------------------------------
# parameters and optimizer state
def _param_vars(model_or_state: Any) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return [(tuple(p), v) for p, v in nnx.to_flat_state(state)]


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def param_specs(model_or_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[Any, Any]:
    """PartitionSpecs of every `nnx.Param`, as a pure dict shaped like `model_to_params(model)`.
    Works on concrete and abstract (`nnx.eval_shape`) models alike."""
    flat = {}
    for path, var in _param_vars(model_or_state):
        name = ".".join(map(str, path))
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"param {name!r} has no `logical_axes` metadata (create it with nn.make_param)")
        flat[path] = logical_to_spec(axes, rules, mesh, var.get_value().shape, what=f"param {name!r}")
    return _nest(flat)


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict[Any, Any]:
    """NamedShardings of every `nnx.Param` (pure dict like `model_to_params(model)`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(model_or_state, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))


def abstract_params(model_or_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                    dtype: Any | None = None) -> dict[Any, Any]:
    """`jax.ShapeDtypeStruct` per param carrying its sharding (no memory): the AOT-compile input.
    `dtype` overrides every param's dtype (e.g. fp32 master weights)."""
    shard = param_shardings(model_or_state, mesh, rules)
    flat = {}
    for path, var in _param_vars(model_or_state):
        v = var.get_value()
        node = shard
        for k in path:
            node = node[k]
        flat[path] = jax.ShapeDtypeStruct(v.shape, dtype or v.dtype, sharding=node)
    return _nest(flat)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Host (or single-device) value -> global array with `sharding`; multi-process safe (every
    process must hold the same full value)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_params(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Moves every param of `model` onto the mesh by the rule table (in place; returns `model`)."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(state, mesh, rules)
    values = jax.tree.map(put, nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)
    return model


def _key_name(k: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def opt_state_shardings(opt_state: Any, params: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state (concrete or `jax.eval_shape` output) that mirrors the params.

    `params`: a tree of NamedSharding, or of arrays / ShapeDtypeStructs carrying `.sharding` (then
    shapes are checked too). A state leaf whose key path ENDS with a param's path (and, when known,
    has its shape) gets that param's sharding: adam mu/nu, momenta, masked states. Everything else
    (step counts, scalars) is replicated; a non-scalar leaf that matches no param is replicated
    with a warning (e.g. factored second moments)."""
    is_sh = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    by_path: dict[tuple[Any, ...], tuple[NamedSharding, tuple[int, ...] | None]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sh)[0]:
        sh = leaf if is_sh(leaf) else leaf.sharding
        by_path[tuple(_key_name(k) for k in path)] = (sh, None if is_sh(leaf) else tuple(leaf.shape))
    depth = max((len(p) for p in by_path), default=0)
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        names = tuple(_key_name(k) for k in path)
        shape = tuple(getattr(leaf, "shape", ()))
        for n in range(min(depth, len(names)), 0, -1):
            hit = by_path.get(names[-n:])
            if hit is not None and (hit[1] is None or hit[1] == shape) and len(hit[0].spec) <= len(shape):
                return hit[0]
        if shape and math.prod(shape) > 1:
            key = ("opt_state", names)
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(f"optimizer state leaf {'.'.join(map(str, names))} {shape} matches no param; replicated")
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES, *, shape: Sequence[int] | None = None,
                   ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input: rows over the `batch` rule, the rest replicated."""
    n = len(shape) if shape is not None else ndim
    axes = ("batch", "length") + (None,) * (n - 2) if n >= 2 else ("batch",)
    return NamedSharding(mesh, logical_to_spec(axes[:n], rules, mesh, shape, what="batch"))


# ---------------------------------------------------------------------------------------------
# the current mesh + rules (context manager only)
@dataclass(frozen=True)
class ShardingContext:
    mesh: Mesh
    rules: Rules = DEFAULT_RULES

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None, *, what: str = "") -> P:
        return logical_to_spec(axes, self.rules, self.mesh, shape, what=what)

    def replace(self, **changes: Any) -> ShardingContext:
        return dataclasses.replace(self, **changes)


_CURRENT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar("clover_sharding", default=None)


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[ShardingContext]:
    """Makes (mesh, rules) current for `constrain` and the expert-parallel MoE, and sets the mesh
    as JAX's context mesh (`jax.set_mesh`) so jit caches traces per mesh."""
    ctx = ShardingContext(mesh, tuple(rules))
    token = _CURRENT.set(ctx)
    try:
        with jax.set_mesh(mesh):
            yield ctx
    finally:
        _CURRENT.reset(token)


def current() -> ShardingContext | None:
    """The active `ShardingContext`, or None outside `use_sharding`."""
    return _CURRENT.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names under the current context; a no-op without one
    (or on a one-device mesh)."""
    ctx = current()
    if ctx is None or ctx.mesh.size == 1:
        return x
    spec = ctx.spec(logical_axes, x.shape, what="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


__all__ = [
    "spec_axes",
    "DEFAULT_RULES", "MESH_AXES", "MeshConfig", "Rules", "ShardingContext", "abstract_params",
    "batch_sharding", "constrain", "current", "logical_to_spec", "make_mesh", "named_sharding",
    "opt_state_shardings", "param_shardings", "param_specs", "put", "rules_dict", "shard_params",
    "use_sharding", "with_rules",
]
