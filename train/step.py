"""The jitted train step (gradient accumulation over micro-batches) and the eval step.

Loss contract: ``loss_fn(params, batch, rng) -> (loss, metrics)``, `loss` a scalar, `metrics` a
dict of arrays. If `metrics` has ``"weight"`` (the loss's normaliser, e.g. the number of loss
tokens in that batch: ``loss = sum_of_token_losses / weight``), micro-batches combine weighted by
it, so a masked-token-mean loss accumulates exactly like one big batch:

    loss = sum_i w_i loss_i / sum_i w_i,   grad = sum_i w_i grad_i / sum_i w_i.

Without ``"weight"`` every micro-batch counts the same (right for per-example means over
equal-size micro-batches). Metrics whose names match `sum_metrics` (counts: ``weight``, ``tokens``,
``num_*``, ``*count*``) are summed over micro-batches; the others are averaged like the loss.

Micro-batch m holds the examples ``i`` with ``i % micro_batches == m`` (a strided split): with the
batch axis sharded over devices, every device then keeps its own rows in every micro-batch, so
the split needs no communication.

Non-finite steps: the metric ``nonfinite`` is 1 when the step's loss, gradient norm or update norm
is NaN/Inf (computed in the graph: reading it costs no host sync of its own; the loop reads it where
the logger fetches the metrics). With ``on_nonfinite="skip"`` such a step keeps the old params and
optimizer state (a select in the graph; the step counter and the rng still advance, so the next step
draws the next batch), with ``"stop"`` it applies the update and the loop stops the run.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.optimizer import Optimizer, path_str
from train.state import FP32_ONLY_PATTERNS, TrainState

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, Mapping[str, jax.Array]]]
StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]

WEIGHT = "weight"
DEFAULT_SUM_METRICS: tuple[str, ...] = (r"^weight$", r"^tokens$", r"^num_", r"count")


def split_micro_batches(batch: Any, micro_batches: int) -> Any:
    """Every leaf [B, ...] -> [micro_batches, B // micro_batches, ...], strided (see module doc)."""
    def split(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        if x.ndim == 0 or x.shape[0] % micro_batches:
            raise ValueError(f"batch leaf {path_str(path) or '<root>'} with shape {tuple(x.shape)}: the "
                             f"leading (batch) axis must be divisible by micro_batches={micro_batches}")
        x = x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree_util.tree_map_with_path(split, batch)


def cast_for_compute(params: Any, compute_dtype: Any, keep_fp32: tuple[str, ...] = FP32_ONLY_PATTERNS) -> Any:
    """Floating params -> `compute_dtype` (None: unchanged), except paths matching `keep_fp32`. Done
    inside the differentiated function, so gradients flow back to the master dtype."""
    if compute_dtype is None:
        return params
    dtype = jnp.dtype(compute_dtype)

    def cast(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating) or any(re.search(p, path_str(path)) for p in keep_fp32):
            return x
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def _is_sum(name: str, sum_metrics: tuple[str, ...]) -> bool:
    return any(re.search(p, name) for p in sum_metrics)


def _check_loss_output(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        raise TypeError("loss_fn must return (loss, metrics_dict)")
    loss, metrics = jnp.asarray(out[0]), out[1]
    if loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")
    for k in ("loss", "grad_norm", "lr", "nonfinite"):
        if k in metrics:
            raise ValueError(f"loss_fn metric name {k!r} is reserved (the step reports it)")
    return loss, dict(metrics)


def _weight(metrics: Mapping[str, jax.Array]) -> jax.Array:
    if WEIGHT not in metrics:
        return jnp.ones((), jnp.float32)
    w = jnp.asarray(metrics[WEIGHT])
    if w.shape != ():
        raise ValueError(f"metric {WEIGHT!r} must be a scalar, got shape {w.shape}")
    return jax.lax.stop_gradient(w.astype(jnp.float32))


def _safe_div(x: jax.Array, w: jax.Array) -> jax.Array:
    # all-zero weight (a batch without loss tokens): report 0, not NaN
    return jnp.where(w > 0, x / jnp.where(w > 0, w, 1.0), jnp.zeros_like(x))


def make_train_step(
    loss_fn: LossFn, optimizer: Optimizer | optax.GradientTransformation, *, micro_batches: int = 1,
    compute_dtype: Any = None, keep_fp32: tuple[str, ...] = FP32_ONLY_PATTERNS,
    sum_metrics: tuple[str, ...] = DEFAULT_SUM_METRICS, in_shardings: Any = None, out_shardings: Any = None,
    donate: bool = True, jit: bool = True, on_nonfinite: str = "stop",
    compiler_options: Mapping[str, Any] | None = None,
) -> StepFn:
    """``step(state, batch) -> (new_state, metrics)``; metrics: ``loss``, ``grad_norm`` (global
    norm of the trainable gradients before clipping), ``lr`` (with an `Optimizer`) and the
    accumulated `loss_fn` metrics, ``nonfinite`` (module docstring; `on_nonfinite` "stop" | "skip").
    `optimizer` may be a bare optax transform (everything trains).

    jitted with the state donated; `in_shardings` / `out_shardings` go to `jax.jit` as given (the
    caller owns the sharding rules), `compiler_options` (XLA options of this platform) too. Frozen
    params are not differentiated and come back unchanged.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if on_nonfinite not in ("stop", "skip"):
        raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {on_nonfinite!r}")
    tx = optimizer.tx if isinstance(optimizer, Optimizer) else optimizer
    schedule = optimizer.schedule if isinstance(optimizer, Optimizer) else None

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        leaves, treedef = jax.tree.flatten(state.params)
        if isinstance(optimizer, Optimizer):
            mask = treedef.flatten_up_to(optimizer.trainable_mask(state.params))
        else:
            mask = [True] * len(leaves)
        train_idx = [i for i, m in enumerate(mask) if m]
        train_leaves = [leaves[i] for i in train_idx]

        def loss_of(tl: list[jax.Array], mb: Any, rng: jax.Array) -> tuple[jax.Array, dict]:
            full = list(leaves)
            for i, x in zip(train_idx, tl):
                full[i] = x
            params = cast_for_compute(jax.tree.unflatten(treedef, full), compute_dtype, keep_fp32)
            return _check_loss_output(loss_fn(params, mb, rng))

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        key = jax.random.wrap_key_data(state.rng)
        next_key, step_key = jax.random.split(key)

        if micro_batches == 1:
            (loss, metrics), grads = grad_fn(train_leaves, batch, step_key)
            metrics = {k: jnp.asarray(v) for k, v in metrics.items()}
        else:
            loss, metrics, grads = _accumulate(grad_fn, train_leaves, batch, step_key, micro_batches, sum_metrics)

        grad_norm = optax.tree.norm(grads)  # before the cast: fp32 accumulators when accumulating
        grads = [g.astype(p.dtype) for g, p in zip(grads, train_leaves)]
        # frozen leaves: zero grads that set_to_zero ignores (dead code for XLA)
        full_grads = [jnp.zeros_like(x) for x in leaves]
        for i, g in zip(train_idx, grads):
            full_grads[i] = g
        updates, opt_state = tx.update(jax.tree.unflatten(treedef, full_grads), state.opt_state, state.params)
        upd_leaves = treedef.flatten_up_to(updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(
            optax.tree.norm([upd_leaves[i] for i in train_idx]))
        new_leaves = list(leaves)
        for i in train_idx:
            new_leaves[i] = (leaves[i] + upd_leaves[i]).astype(leaves[i].dtype)
        if on_nonfinite == "skip":
            # not optax.apply_if_finite: it changes the optimizer state's tree (old checkpoints and
            # the opt-state shardings would no longer fit) and looks at the updates only
            new_leaves = [jnp.where(finite, n, o) for n, o in zip(new_leaves, leaves)]
            opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), opt_state, state.opt_state)
        out = {"loss": loss.astype(jnp.float32), "grad_norm": grad_norm.astype(jnp.float32),
               "nonfinite": (~finite).astype(jnp.float32), **metrics}
        if schedule is not None:
            out["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = TrainState(params=jax.tree.unflatten(treedef, new_leaves), opt_state=opt_state,
                               step=state.step + 1, rng=jax.random.key_data(next_key))
        return new_state, out

    if not jit:
        return step
    kw: dict[str, Any] = {}
    if in_shardings is not None:
        kw["in_shardings"] = in_shardings
    if out_shardings is not None:
        kw["out_shardings"] = out_shardings
    if compiler_options:
        kw["compiler_options"] = dict(compiler_options)
    return jax.jit(step, donate_argnums=(0,) if donate else (), **kw)


def _accumulate(grad_fn: Callable, train_leaves: list[jax.Array], batch: Any, step_key: jax.Array,
                micro_batches: int, sum_metrics: tuple[str, ...]) -> tuple[jax.Array, dict, list[jax.Array]]:
    """lax.scan over micro-batches; fp32 accumulators of w*grad, w*loss, w*metric (or sum)."""
    mbs = split_micro_batches(batch, micro_batches)
    first = jax.tree.map(lambda x: x[0], mbs)
    # shapes of one micro-batch's metrics, to size the carry (no compute: eval_shape)
    (_, m_shape), _ = jax.eval_shape(grad_fn, train_leaves, first, step_key)
    sum_names = {k for k in m_shape if _is_sum(k, sum_metrics)}

    def zeros_metric(k: str, s: jax.ShapeDtypeStruct) -> jax.Array:
        dt = s.dtype if k in sum_names else jnp.float32
        return jnp.zeros(s.shape, dt)

    carry0 = (
        [jnp.zeros(x.shape, jnp.float32) for x in train_leaves],
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.float32),
        {k: zeros_metric(k, s) for k, s in m_shape.items()},
    )

    def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        g_acc, l_acc, w_acc, m_acc = carry
        mb, idx = xs
        (loss, metrics), g = grad_fn(train_leaves, mb, jax.random.fold_in(step_key, idx))
        w = _weight(metrics)
        g_acc = [a + w * gi.astype(jnp.float32) for a, gi in zip(g_acc, g)]
        m_acc = {k: m_acc[k] + (jnp.asarray(v).astype(m_acc[k].dtype) if k in sum_names
                                else w * jnp.asarray(v, jnp.float32))
                 for k, v in metrics.items()}
        return (g_acc, l_acc + w * loss.astype(jnp.float32), w_acc + w, m_acc), None

    (g_acc, l_acc, w_acc, m_acc), _ = jax.lax.scan(body, carry0, (mbs, jnp.arange(micro_batches)))
    grads = [_safe_div(g, w_acc) for g in g_acc]
    metrics = {k: (v if k in sum_names else _safe_div(v, w_acc)) for k, v in m_acc.items()}
    return _safe_div(l_acc, w_acc), metrics, grads


def make_eval_step(
    loss_fn: LossFn, *, compute_dtype: Any = None, keep_fp32: tuple[str, ...] = FP32_ONLY_PATTERNS,
    jit: bool = True,
) -> Callable[[Any, Any, jax.Array], dict[str, jax.Array]]:
    """``eval_step(params, batch, rng) -> metrics`` (``loss`` plus the `loss_fn` metrics), no grads."""
    def eval_step(params: Any, batch: Any, rng: jax.Array) -> dict[str, jax.Array]:
        p = cast_for_compute(params, compute_dtype, keep_fp32)
        loss, metrics = _check_loss_output(loss_fn(p, batch, jax.random.wrap_key_data(rng)))
        return {"loss": loss.astype(jnp.float32), **metrics}

    return jax.jit(eval_step) if jit else eval_step


def evaluate(
    eval_step: Callable[[Any, Any, jax.Array], dict[str, jax.Array]], params: Any, batches: Iterable[Any], *,
    steps: int, seed: int = 0, sum_metrics: tuple[str, ...] = DEFAULT_SUM_METRICS,
) -> dict[str, Any]:
    """Runs `steps` eval batches (fewer if `batches` ends) and combines them like micro-batches
    (weighted by ``weight`` when present). Returns host values (floats; numpy for array metrics)."""
    base = jax.random.key_data(jax.random.key(seed))
    totals: dict[str, np.ndarray] = {}
    w_total, n = 0.0, 0
    for i, batch in zip(range(steps), batches):
        m = jax.device_get(eval_step(params, batch, jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(base), i))))
        w = float(m.get(WEIGHT, 1.0))
        for k, v in m.items():
            v = np.asarray(v, np.float64)
            totals[k] = totals.get(k, 0.0) + (v if _is_sum(k, sum_metrics) else w * v)
        w_total += w
        n += 1
    if n == 0:
        raise ValueError("evaluate: the eval batches iterator is empty")
    out: dict[str, Any] = {}
    for k, v in totals.items():
        v = v if _is_sum(k, sum_metrics) else (v / w_total if w_total > 0 else np.zeros_like(v))
        out[k] = float(v) if np.ndim(v) == 0 else v
    return out


__all__ = ["DEFAULT_SUM_METRICS", "LossFn", "StepFn", "WEIGHT", "cast_for_compute", "evaluate",
           "make_eval_step", "make_train_step", "split_micro_batches"]
