"""Multi-host start-up and per-host data feeding (JAX's own multi-controller runtime, docs/design.md 4).

Every process runs the same program on its local devices; `maybe_initialize()` joins them into one
runtime when the environment says there are several (a TPU pod slice, SLURM / Open MPI jobs, or the
explicit `JAX_COORDINATOR_ADDRESS` + `JAX_NUM_PROCESSES` + `JAX_PROCESS_ID` triple, which is also how
the CPU test runs two local processes over gloo collectives). Call it before anything touches a
JAX device.

Data: each process loads only the global batch rows its devices hold (`process_rows`) and
`global_batch` assembles the global `jax.Array` from those local rows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedConfig:
    """Explicit settings; None fields are taken from the environment (or JAX's cluster detection)."""

    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300  # seconds to wait for every process to join


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def detect(env: Mapping[str, str] | None = None) -> str | None:
    """Why this looks like a multi-process launch (a short reason), or None for a single process."""
    env = os.environ if env is None else env
    if env.get("CLOVER_DISTRIBUTED", "") not in ("", "0"):
        return "CLOVER_DISTRIBUTED"
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if (_int_env(env, "SLURM_NTASKS") or 1) > 1:
        return "SLURM"
    if (_int_env(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "Open MPI"
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "TPU multi-slice"
    hosts = env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or ""
    # libtpu off a TPU VM fills TPU_WORKER_HOSTNAMES with "WARNING: could not determine ..., ..."
    if not hosts.startswith("WARNING") and len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "TPU pod slice"
    return None


def maybe_initialize(cfg: DistributedConfig | None = None, *, env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` when `cfg` has a coordinator or the environment shows
    several processes; returns whether the process is now part of a multi-process runtime.
    Idempotent. On CPU the cross-process collectives use gloo."""
    env = os.environ if env is None else env
    cfg = cfg or DistributedConfig()
    if jax.distributed.is_initialized():
        return True
    reason = "config" if cfg.coordinator_address else detect(env)
    if reason is None:
        return False
    num = cfg.num_processes if cfg.num_processes is not None else _int_env(env, "JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _int_env(env, "JAX_PROCESS_ID")
    if "cpu" in env.get("JAX_PLATFORMS", "").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("jax.distributed.initialize (%s): coordinator=%s processes=%s id=%s", reason,
             cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS"), num, pid)
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address, num_processes=num, process_id=pid,
        local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
        initialization_timeout=cfg.initialization_timeout,
    )
    return True


def is_coordinator() -> bool:
    """True on process 0 (the one that logs and writes run files)."""
    return jax.process_index() == 0


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous rows of dim 0 that this process's devices hold under `sharding` (the rows it
    must load). Raises if they are not contiguous (a mesh whose batch axes interleave processes)."""
    spans = set()
    for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        s = idx[0] if idx else slice(None)
        spans.add((s.start or 0, global_shape[0] if s.stop is None else s.stop))
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = np.zeros(hi - lo, bool)
    for a, b in spans:
        covered[a - lo:b - lo] = True
    if not covered.all():
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows {sorted(spans)}; "
                         "order the mesh so that the batch axes split by process first")
    return slice(lo, hi)


def global_batch(local: Any, sharding: jax.sharding.Sharding, global_rows: int) -> Any:
    """Host-local rows (an array or a dict of arrays, each [local_rows, ...], as `process_rows` says)
    -> global `jax.Array`s of `global_rows` rows with `sharding`."""
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])

    return jax.tree.map(one, local)


__all__ = ["DistributedConfig", "detect", "global_batch", "is_coordinator", "maybe_initialize", "process_rows"]
