"""Train checkpoints: an Orbax `CheckpointManager` over `checkpoint.dir`, one step directory each.

Items of a step directory ``<dir>/<step>/``:

    params/     the master params pytree (StandardSave: sharded arrays, restorable to any sharding);
                with `checkpoint.save_frozen: false` only the trained ones (`params_mask`)
    opt_state/  the optax state pytree
    progress/   {"step": int32 [], "rng": uint32 key data}, and without the frozen params their
                fingerprint ``frozen_sum_abs`` fp32 [n] (sum |x| per frozen floating leaf)
    data/       JSON: the data iterator's state after the last batch of that step (opaque to us)
    config/     JSON: the run config the caller handed over (for provenance and `export`)

Atomicity is Orbax's: a save writes ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
only when every item is complete (on filesystems without atomic rename, e.g. GCS, it writes a commit
file instead). A process killed mid-save leaves only the tmp directory, which `all_steps()` never
lists and the next manager deletes, so a restore always takes the newest complete step.

No checkpoint holds non-finite params: `save` checks them first and refuses (naming the first bad
leaf), so keep-N retention never pushes out the newest finite checkpoint. A background (async) write
that fails (disk full, bucket permission) is kept by Orbax in its finalize thread; `check()` (the
loop calls it after every step), `save`, `wait` and `close` raise it as one `CheckpointSaveError`
naming the step dir and the OS error. Orbax deletes older steps only after a write is final, so the
last complete checkpoint survives a failed one; Orbax's own tracebacks of that failure are dropped
from the log (the error is reported once, by us).

Trained params only (`save_frozen: false`, a LoRA run's adapters beside a frozen 35B base): the
frozen params never change, so a checkpoint need not hold them; `restore` takes them from the run's
initial params (`frozen`, re-read from its init checkpoint) and first compares their fingerprint
with the one saved, so a resume on other base weights (a changed or replaced init dir) is refused
instead of silently training adapters against the wrong model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from train.config import CheckpointConfig
from train.optimizer import path_str
from train.remote import epath_of, is_remote
from train.state import TrainState

log = logging.getLogger(__name__)

ARRAY_ITEMS = ("params", "opt_state", "progress")
JSON_ITEMS = ("data", "config")
FINGERPRINT = "frozen_sum_abs"
#: frozen params re-read for a resume must match the saved fingerprint to this relative tolerance
#: (a sum over other shardings rounds differently; other weights differ by far more)
FINGERPRINT_RTOL = 1e-4


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored into the given state; the message names the item/key."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint write failed (in the background for async saves); one line: step dir + OS error."""


def error_line(e: BaseException, limit: int = 300) -> str:
    """One line of an Orbax / TensorStore / OS error: its first line without the TensorStore spec dump."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" [tensorstore_spec=")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _DropOrbaxSaveTracebacks(logging.Filter):
    """Orbax logs a failed background save with several tracebacks (absl logger, ERROR): we raise it
    once as `CheckpointSaveError`, so those records are dropped (kept at DEBUG in train.checkpoint)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and "/orbax/" in record.pathname:
            log.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


_ORBAX_FILTER = _DropOrbaxSaveTracebacks()


def first_nonfinite_leaf(tree: Any) -> str | None:
    """Dotted path of the first floating leaf holding a NaN / Inf (one host sync for all leaves)."""
    leaves = [(path_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    flags = jax.device_get([jnp.all(jnp.isfinite(x)) for _, x in leaves])
    return next((name for (name, _), ok in zip(leaves, flags) if not bool(ok)), None)


def subset(tree: Any, mask: Any) -> dict[str, Any]:
    """The leaves of the nested-dict `tree` where `mask` (same structure, bools) is True, as nested
    dicts; subtrees left empty are dropped."""
    if isinstance(tree, Mapping):
        out = {k: subset(v, mask[k]) for k, v in tree.items()}
        return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
    return tree if mask else {}


def merge_subset(full: Any, part: Mapping[str, Any]) -> Any:
    """`full` with every leaf that `part` (a `subset` of the same structure) holds taken from it."""
    if isinstance(full, Mapping):
        return {k: (merge_subset(v, part[k]) if k in part else v) for k, v in full.items()}
    return part


def _frozen_leaves(params: Any, mask: Any) -> list[tuple[str, Any]]:
    """(path, leaf) of the floating leaves where `mask` is False (arrays or ShapeDtypeStructs)."""
    return [(path_str(p), x) for (p, x), m in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(mask))
            if not m and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


@jax.jit
def _sums_abs(xs: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in xs]) if xs else jnp.zeros((0,), jnp.float32)


def frozen_fingerprint(params: Any, mask: Any) -> tuple[list[str], jax.Array]:
    """(paths, fp32 [n] sum |x|) of the floating leaves where `mask` is False: what a checkpoint
    without them records, to recognise the weights it was trained against."""
    items = _frozen_leaves(params, mask)
    return [p for p, _ in items], _sums_abs([x for _, x in items])


def check_frozen(where: str, params: Any, mask: Any, saved: Any) -> None:
    """Raises `CheckpointError` unless the frozen leaves of `params` (the run's initial params,
    re-read) have the fingerprint `saved` that the checkpoint `where` recorded (FINGERPRINT_RTOL);
    the message names the first leaf that differs."""
    paths, now = frozen_fingerprint(params, mask)
    now, saved = np.asarray(jax.device_get(now)), np.asarray(jax.device_get(saved))
    if now.shape != saved.shape:
        raise CheckpointError(f"checkpoint {where} was trained with {saved.size} frozen params, this run has "
                              f"{now.size}: not the same model")
    bad = np.flatnonzero(~np.isclose(now, saved, rtol=FINGERPRINT_RTOL, atol=0.0))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"checkpoint {where} holds only the trained params, and the frozen ones re-read from the run's initial "
            f"weights are not those it was trained with: {paths[i]!r} sum |x| {now[i]:.6g}, saved {saved[i]:.6g} "
            f"({bad.size} of {len(paths)} differ); use the model.init_from the run started from")


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """Restore target of one leaf: shape, dtype and sharding (the target layout, which may differ from
    the saved one). Leaves without a sharding (plain `eval_shape`) land on the first local device."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)


def _json_checked(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serialisable: {e}") from None
    return value


class Checkpointer:
    """Saves / restores `TrainState` + data state + run config under `cfg.dir`.

    `save` returns once the arrays are copied off the device (async mode), so the caller may donate
    the state to the next step right away; `wait()` blocks until the write is final.
    """

    def __init__(self, cfg: CheckpointConfig, *, run_config: Mapping[str, Any] | None = None,
                 params_mask: Any = None):
        """`params_mask` (params-shaped bools, True = trained): what a `save_frozen: false`
        checkpoint holds; required then, ignored otherwise."""
        if cfg.dir is None:
            raise CheckpointError("checkpoint.dir is not set")
        if not cfg.save_frozen and params_mask is None:
            raise CheckpointError("checkpoint.save_frozen: false needs to know which params train: this run "
                                  "gives no trainable mask (the SFT recipe does); set save_frozen: true")
        self.cfg = cfg
        self.params_mask = None if cfg.save_frozen else params_mask
        self._fingerprint: jax.Array | None = None  # of the frozen params, computed at the first save
        # a URI (gs://...) goes to Orbax as an epath: it reads and writes buckets itself
        self.directory = epath_of(cfg.dir) if is_remote(cfg.dir) else Path(cfg.dir).absolute()
        self.run_config = _json_checked(dict(run_config or {}), "run_config")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,
        )
        # explicit handlers: a fresh manager then reads item metadata before any save/restore
        handlers = {**{k: ocp.StandardCheckpointHandler() for k in ARRAY_ITEMS},
                    **{k: ocp.JsonCheckpointHandler() for k in JSON_ITEMS}}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._pending: int | None = None  # step of a save issued and not yet known to be final
        logging.getLogger("absl").addFilter(_ORBAX_FILTER)  # once per process (addFilter dedups)

    # ------------------------------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Periodic save due after `step` updates (every_steps = 0: never periodic)."""
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # ------------------------------------------------------------------------------------------ save
    def save(self, state: TrainState, *, data_state: Mapping[str, Any] | None = None) -> int:
        """Saves `state` under its own step; a step already on disk is left alone. Returns the step."""
        step = int(jax.device_get(state.step))
        self.check(block=True)
        if step in self.manager.all_steps():
            return step
        bad = first_nonfinite_leaf(state.params)
        if bad is not None:
            raise CheckpointError(f"refusing to save step {step} to {self.step_dir(step)}: params leaf {bad!r} "
                                  "is not finite (NaN/Inf); the checkpoints on disk are left as they are")
        data = _json_checked(dict(data_state or {}), f"data iterator state at step {step}")
        params, progress = state.params, {"step": state.step, "rng": state.rng}
        if self.params_mask is not None:  # the trained params only, and the frozen ones' fingerprint
            if self._fingerprint is None:
                self._fingerprint = frozen_fingerprint(state.params, self.params_mask)[1]
            params, progress = subset(params, self.params_mask), {**progress, FINGERPRINT: self._fingerprint}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            progress=ocp.args.StandardSave(progress),
            data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(self.run_config),
        )
        self._pending = step
        try:
            self.manager.save(step, args=args, force=True)
        except (OSError, ValueError) as e:  # a synchronous save writes in the foreground
            self._pending = None
            raise self._save_error(step, e) from None
        if not self.cfg.async_save:
            self._pending = None
        return step

    def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
        try:
            self.manager.reload()  # the manager already forgot the steps it meant to delete after this one
        except Exception:  # noqa: BLE001 - only the message's last line depends on it
            pass
        kept = [s for s in self.all_steps() if s != step]
        last = f"the last complete checkpoint (step {kept[-1]}) is kept" if kept else "no complete checkpoint yet"
        return CheckpointSaveError(f"checkpoint save of step {step} to {self.step_dir(step)} failed: "
                                   f"{error_line(e)}; {last}")

    def check(self, *, block: bool = False) -> None:
        """Raises `CheckpointSaveError` if the pending background save failed. Without `block` a save
        still being written is left alone (no wait), so calling this after every step is cheap."""
        if self._pending is None or (not block and self.manager.is_saving_in_progress()):
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - whatever the writer raised, reported as one line
            raise self._save_error(step, e) from None

    def wait(self) -> None:
        self.check(block=True)
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()

    # ------------------------------------------------------------------------------------------ restore
    def _check_item(self, step: int, item: str, target: Any) -> None:
        """Same leaf names and shapes as the checkpoint, else an error naming the first difference."""
        meta = self.manager.item_metadata(step)[item]
        if meta is None:
            raise CheckpointError(f"checkpoint {self.step_dir(step)}: no metadata for item {item!r}")
        tree = getattr(meta, "tree", meta)
        saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(tree) if hasattr(m, "shape")}
        want = {path_str(p): tuple(jnp.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(target)}
        where = f"checkpoint {self.step_dir(step)} item {item!r}"
        hint = {"opt_state": " (did optimizer.trainable / optimizer.frozen change?)",
                "params": " (did checkpoint.save_frozen or the trained params change?)"}.get(item, "")
        for k in want:
            if k not in saved:
                raise CheckpointError(f"{where}: missing {k!r}{hint}")
        extra = sorted(set(saved) - set(want))
        if extra:
            raise CheckpointError(f"{where}: unexpected entries {extra[:5]}{hint}")
        for k, sh in want.items():
            if saved[k] != sh:
                raise CheckpointError(f"{where}: {k!r} has shape {saved[k]}, expected {sh}")

    def restore(self, abstract_state: TrainState, step: int | None = None, frozen: Callable[[], Any] | None = None
                ) -> tuple[TrainState, dict[str, Any], dict[str, Any]]:
        """(state, data_state, run_config) of `step` (default: the newest complete one), with every
        array in the dtype and sharding of `abstract_state` (arrays or ShapeDtypeStructs).
        `frozen()`: the run's initial params, where a `save_frozen: false` checkpoint takes its
        frozen params from (their fingerprint checked first)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self.manager.all_steps():
            raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}; "
                                  f"have {self.all_steps()}")
        targets = {
            "params": abstract_state.params,
            "opt_state": abstract_state.opt_state,
            "progress": {"step": abstract_state.step, "rng": abstract_state.rng},
        }
        mask = self.params_mask
        if mask is not None:
            if frozen is None:
                raise CheckpointError(f"checkpoint {self.step_dir(step)} holds only the trained params: restoring "
                                      "it needs the run's initial params for the frozen ones")
            n = len(_frozen_leaves(abstract_state.params, mask))
            targets["params"] = subset(abstract_state.params, mask)
            targets["progress"][FINGERPRINT] = jax.ShapeDtypeStruct((n,), jnp.float32)
        for item, target in targets.items():
            self._check_item(step, item, target)
        args = ocp.args.Composite(
            **{k: ocp.args.StandardRestore(jax.tree.map(_abstract, v)) for k, v in targets.items()},
            data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
        )
        out = self.manager.restore(step, args=args)
        progress, params = out["progress"], out["params"]
        if mask is not None:
            initial = frozen()
            check_frozen(str(self.step_dir(step)), initial, mask, progress[FINGERPRINT])
            params = merge_subset(initial, params)
        state = TrainState(params=params, opt_state=out["opt_state"], step=progress["step"],
                           rng=progress["rng"])
        if int(jax.device_get(state.step)) != step:
            raise CheckpointError(f"checkpoint {self.step_dir(step)}: stored step "
                                  f"{int(jax.device_get(state.step))} != directory step {step}")
        return state, dict(out["data"] or {}), dict(out["config"] or {})

    def restore_config(self, step: int) -> dict[str, Any]:
        """Only the run config item of `step` (JSON, cheap: read before any array)."""
        out = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(out["config"] or {})

    def restore_params(self, abstract_params: Any, step: int | None = None) -> Any:
        """Only the params item (eval, export), in the layout of `abstract_params`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        self._check_item(step, "params", abstract_params)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(jax.tree.map(_abstract, abstract_params))))
        return out["params"]


__all__ = ["CheckpointError", "CheckpointSaveError", "Checkpointer", "error_line", "first_nonfinite_leaf",
           "check_frozen", "frozen_fingerprint", "merge_subset", "subset"]
