"""Ground floor for scale: the mesh and the one logical-axis rule table, multi-host start-up, remat.

- `sharding`: `MeshConfig`, `make_mesh`, THE rule table (`DEFAULT_RULES`: logical names -> mesh
  axes), `constrain`, parameter / batch shardings and the `use_sharding` context;
- `distributed`: `jax.distributed` start-up from the environment and per-host batch rows;
- `remat`: the named `jax.checkpoint` policies and the tensor tags they save.

May import: jax / numpy / flax only. Nothing of the project: `model` and everything above build on
this room, so an import from here upwards would be a cycle waiting to happen (docs/architecture.md).
"""
