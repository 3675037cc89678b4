"""Named rematerialisation policies for the scanned layer stack (what `jax.checkpoint` needs).

A policy decides which intermediates of one layer group the backward pass may keep; everything
else is recomputed from the group's input. Names:

* `none`: no `jax.checkpoint` at all (autodiff keeps every residual; fastest, most memory);
* `full`: keep nothing but the group input (`nothing_saveable`);
* `dots_saveable`: keep every matmul output;
* `dots_with_no_batch_dims_saveable`: keep matmul outputs without batch dims (projections, not
  attention scores or per-expert batched products);
* `save_moe_and_attn_out`: keep only the tensors tagged `moe_out` (the MoE block output) and
  `attn_out` (the mixer output, attention or GDN);
* `save_dots_and_moe_out`: both of the above kinds;
* `offload_moe_and_attn_out`: like `save_moe_and_attn_out`, but the tagged tensors go to pinned
  host memory (TPU/GPU; no effect on CPU).

Model code tags tensors with `tag(x, MOE_OUT)` / `tag(x, ATTN_OUT)` (an identity outside a policy).

The layer stack takes its policy explicitly (`run_stack(..., remat=NAME)`), else from the
`use_policy(NAME)` context (a planner or trainer choosing it without threading an argument through
every forward), else from the model config (`ModelConfig.remat`, e.g. `model.remat: full` in a
recipe). Like `sharding.use_sharding`, enter the context outside `jax.jit`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
from jax.ad_checkpoint import checkpoint_name

MOE_OUT = "moe_out"
ATTN_OUT = "attn_out"

_cp = jax.checkpoint_policies

POLICIES: dict[str, Callable[[], Any] | None] = {
    "none": None,
    "full": lambda: _cp.nothing_saveable,
    "dots_saveable": lambda: _cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": lambda: _cp.dots_with_no_batch_dims_saveable,
    "save_moe_and_attn_out": lambda: _cp.save_only_these_names(MOE_OUT, ATTN_OUT),
    "save_dots_and_moe_out": lambda: _cp.save_from_both_policies(
        _cp.dots_with_no_batch_dims_saveable, _cp.save_only_these_names(MOE_OUT, ATTN_OUT)),
    "offload_moe_and_attn_out": lambda: _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[MOE_OUT, ATTN_OUT],
        offload_src="device", offload_dst="pinned_host"),
}


def resolve(policy: str | bool | None) -> str:
    """Canonical policy name; `True` means `full` and `False`/`None` mean `none` (the old bool flag)."""
    if policy is True:
        return "full"
    if policy is False or policy is None:
        return "none"
    if policy not in POLICIES:
        import difflib

        near = difflib.get_close_matches(str(policy), POLICIES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"unknown remat policy {policy!r}{hint}; known: {', '.join(POLICIES)}")
    return policy


def checkpoint_policy(policy: str | bool | None) -> Callable[..., Any] | None:
    """The `policy=` argument of `jax.checkpoint` for a name; None for `none` (no checkpoint)."""
    make = POLICIES[resolve(policy)]
    return None if make is None else make()


def apply(fn: Callable[..., Any], policy: str | bool | None, *, prevent_cse: bool = False,
          static_argnums: tuple[int, ...] = ()) -> Callable[..., Any]:
    """`fn` wrapped in `jax.checkpoint` with the named policy (`fn` itself for `none`).
    `prevent_cse=False` is right inside `lax.scan` (the scan already stops CSE across steps)."""
    name = resolve(policy)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=checkpoint_policy(name), prevent_cse=prevent_cse,
                          static_argnums=static_argnums)


_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("clover_remat", default=None)


@contextlib.contextmanager
def use_policy(policy: str | bool | None) -> Iterator[str]:
    """Makes `policy` the one `current()` returns (for stacks called without an explicit policy)."""
    token = _CURRENT.set(resolve(policy))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current() -> str:
    """The policy of the innermost `use_policy`, `none` outside any."""
    return _CURRENT.get() or "none"


def override() -> str | None:
    """The policy of the innermost `use_policy`, None outside any (then the model config decides)."""
    return _CURRENT.get()


def tag(x: jax.Array, name: str) -> jax.Array:
    """Names `x` for the name-based policies (identity in the forward value)."""
    return checkpoint_name(x, name)


__all__ = ["ATTN_OUT", "MOE_OUT", "POLICIES", "apply", "checkpoint_policy", "current", "override", "resolve", "tag", "use_policy"]
