"""Running the Pallas GDN kernel on sharded inputs: ``shard_map`` over batch and head axes.

Mosaic / Triton custom calls cannot be auto-partitioned by XLA, so with a multi-device mesh the
kernel must see per-device blocks. The chunked GDN is independent across batch rows and heads, and
sequential along T; so the kernel runs under ``jax.shard_map`` with batch and heads sharded and T,
dk, dv replicated (whatever the inputs' actual sharding, ``shard_map`` reshards them to that).

Which mesh: an explicit ``mesh`` argument, else the mesh set with ``jax.set_mesh`` (read through
``jax.sharding.get_abstract_mesh()``); none, or a 1-device mesh, means no ``shard_map``.
Which axes: explicit ``batch_axes`` / ``head_axes``, else this project's defaults (docs/design.md 4:
batch -> data, fsdp, expert; heads -> tensor), keeping only axes that exist in the mesh, have size
> 1, and (together) divide the dimension; the kernel is replicated over the mesh axes left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

DEFAULT_BATCH_AXES = ("data", "fsdp", "expert")
DEFAULT_HEAD_AXES = ("tensor",)


def active_mesh(mesh=None):
    """The mesh to shard over: ``mesh`` if given, else the one set by ``jax.set_mesh``, else None
    (also when every axis has size 1 or is already Manual, i.e. inside a shard_map over it)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or not mesh.shape:
        return None
    manual = set(getattr(mesh, "manual_axes", ()))
    if all(int(n) == 1 or a in manual for a, n in mesh.shape.items()):
        return None
    return mesh


def _pick_axes(mesh, dim: int, wanted: Sequence[str], taken: set[str], what: str, explicit: bool) -> tuple[str, ...]:
    picked, prod = [], 1
    # axes already Manual (we are inside someone's shard_map) are per-device here: never re-shard them
    taken = set(taken) | set(getattr(mesh, "manual_axes", ()))
    for name in wanted:
        if name not in mesh.shape:
            if explicit:
                raise ValueError(f"GDN sharding: {what} axis {name!r} is not a mesh axis {tuple(mesh.shape)}")
            continue
        size = int(mesh.shape[name])
        if name in taken or size == 1:
            continue
        if dim % (prod * size):
            if explicit:
                raise ValueError(f"GDN sharding: {what} dim {dim} is not divisible by mesh axes "
                                 f"{tuple(picked) + (name,)} (sizes product {prod * size})")
            continue
        picked.append(name)
        prod *= size
    return tuple(picked)


def gdn_mesh_axes(mesh, B: int, H: int, batch_axes: Sequence[str] | None = None,
                  head_axes: Sequence[str] | None = None) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """(batch mesh axes, head mesh axes) for PartitionSpecs, None where the dim stays replicated."""
    b = _pick_axes(mesh, B, DEFAULT_BATCH_AXES if batch_axes is None else batch_axes, set(), "batch",
                   batch_axes is not None)
    h = _pick_axes(mesh, H, DEFAULT_HEAD_AXES if head_axes is None else head_axes, set(b), "head",
                   head_axes is not None)
    return b or None, h or None


def run_sharded(fn, mesh, in_specs: tuple, out_specs: tuple, *args):
    """``jax.shard_map(fn)(*args)``. On a mesh with Explicit axes shard_map requires the inputs to
    already carry ``in_specs``, so they are resharded first; Auto axes reshard implicitly."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    if explicit:
        args = tuple(jax.sharding.reshard(a, s) for a, s in zip(args, in_specs))
    kw = {}
    manual = set(getattr(mesh, "manual_axes", ()))
    if manual:  # nested in a shard_map: take the remaining axes manual too (kernels cannot be auto-partitioned)
        kw["axis_names"] = frozenset(mesh.axis_names) - manual
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kw)(*args)
