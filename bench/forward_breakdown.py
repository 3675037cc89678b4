"""Per-module fwd and fwd+bwd times, ours vs transformers' torch modules, at the model's shapes
(`python bench/forward.py --breakdown`). Each module runs alone as its own jitted function on a
random input [B, T, D]; fwd+bwd is the gradient of `sum(out * cotangent)` w.r.t. the module's
parameters and its input (what the module costs inside the full backward). The `full model` row
is the scanned stack with embedding, lm_head and loss (bench/forward.py's own measurement).

The torch modules run in their own process (`common.in_own_process`): right after JAX in the same
process their times came out several-fold slow (rmsnorm tens of ms)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax.model import moe as moe_lib
from clover_jax.model.clover_model import create_model
from common import chunked_ce, in_own_process, timeit as _best  # bench/ is on sys.path when forward.py runs


def _jax_pair(module: nnx.Module, fn: Callable, x: jax.Array, repeats: int) -> tuple[float, float]:
    """(fwd s, fwd+bwd s) of `fn(module, x)` (params and x differentiated)."""
    gdef, state = nnx.split(module)
    out = fn(nnx.merge(gdef, state), x)
    ct = jax.tree.map(lambda o: jnp.ones_like(o) * 0.01, out)

    def run(st, xx):
        return fn(nnx.merge(gdef, st), xx)

    def lossf(st, xx):
        o = run(st, xx)
        return sum(jnp.sum(a.astype(jnp.float32) * c) for a, c in zip(jax.tree.leaves(o), jax.tree.leaves(ct)))

    f = jax.jit(run)
    g = jax.jit(jax.grad(lossf, argnums=(0, 1)))
    return (_best(lambda: jax.block_until_ready(f(state, x)), repeats),
            _best(lambda: jax.block_until_ready(g(state, x)), repeats))


def jax_rows(cfg, ids_np: np.ndarray, repeats: int) -> dict[str, tuple[float, float]]:
    model = create_model(cfg)
    b, t = ids_np.shape
    d = cfg.hidden_size
    x = jnp.asarray(np.random.RandomState(1).randn(b, t, d).astype(np.float32))
    ids = jnp.asarray(ids_np)
    gdef, state = nnx.split(model.groups)
    group = nnx.merge(gdef, jax.tree.map(lambda a: a[0], state))
    j_attn = next(j for j in range(cfg.group_size) if cfg.layer_types[j] == "full_attention")
    j_gdn = next(j for j in range(cfg.group_size) if cfg.layer_types[j] != "full_attention")
    la, lg = getattr(group, f"layer_{j_attn}"), getattr(group, f"layer_{j_gdn}")
    seg = jnp.ones((b, t), jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ctx = model._contexts(seg, slots, slots, slots, seg, jnp.full((b, cfg.linear_conv_kernel_dim - 1), -1, jnp.int32),
                          jnp.zeros((b,), bool))
    k = cfg.num_experts_per_tok
    xt = x.reshape(b * t, d)
    _, w_TK, e_TK = moe_lib.route(lg.moe.router(xt), k)
    impl = moe_lib.resolve_impl(cfg.moe_impl)
    rows = {
        "embedding": _jax_pair(model.embed, lambda m, _: m(ids, x.dtype), x, repeats),
        "rmsnorm": _jax_pair(la.input_norm, lambda m, xx: m(xx), x, repeats),
        "attention": _jax_pair(la.attn, lambda m, xx: m(xx, ctx["attn"], None)[0], x, repeats),
        "gdn": _jax_pair(lg.gdn, lambda m, xx: m(xx, ctx["gdn"], None)[0], x, repeats),
        "moe (whole block)": _jax_pair(lg.moe, lambda m, xx: m(xx, ctx)[0], x, repeats),
        "moe router (+top-k)": _jax_pair(lg.moe, lambda m, xx: moe_lib.route(m.router(xx.reshape(b * t, d)), k)[1],
                                         x, repeats),
        f"moe routed experts ({impl})": _jax_pair(
            lg.moe, lambda m, xx: moe_lib.EXPERT_IMPLS[impl](xx.reshape(b * t, d), w_TK, e_TK, m.wi_gate[...],
                                                             m.wi_up[...], m.wo[...]), x, repeats),
        "moe shared expert": _jax_pair(
            lg.moe, lambda m, xx: m.shared_down_proj(jax.nn.silu(m.shared_gate_proj(xx)) * m.shared_up_proj(xx)),
            x, repeats),
        "lm_head + loss": _jax_pair(model, lambda m, xx: _jax_loss(m.logits(m.final_norm(xx)), ids), x, repeats),
        "lm_head + chunked CE": _jax_pair(model, lambda m, xx: chunked_ce(m, m.final_norm(xx), ids), x, repeats),
    }
    # routed-expert pieces with a fixed routing: dispatch (sort + gather), grouped FFN, combine
    flat_e = e_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    sizes = jnp.bincount(flat_e, length=cfg.num_experts).astype(jnp.int32)
    xs = xt[order // k]
    rows["  grouped FFN only"] = _jax_pair(
        lg.moe, lambda m, xx: moe_lib.grouped_ffn(xx, sizes, m.wi_gate[...], m.wi_up[...], m.wo[...], impl), xs,
        repeats)
    rows["  combine only"] = _jax_pair(lg.moe, lambda m, yy: moe_lib.combine(yy, order, w_TK), xs, repeats)
    return rows


def _jax_loss(logits_BTV, ids_BT):
    lp = jax.nn.log_softmax(logits_BTV, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, ids_BT[..., None], axis=-1))


def torch_rows(cfg, ids_np: np.ndarray, repeats: int) -> dict[str, tuple[float, float]]:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(hf).float()
    b, t = ids_np.shape
    x0 = torch.tensor(np.random.RandomState(1).randn(b, t, cfg.hidden_size).astype(np.float32))
    ids = torch.tensor(ids_np)
    layers = model.model.layers
    la = next(l for l in layers if l.block_type == "full_attention")
    lg = next(l for l in layers if l.block_type != "full_attention")
    pos = torch.arange(t)[None].expand(b, t)
    pe = model.model.rotary_emb(x0, pos)

    def pair(mod, fn, need_x=True):
        def fwd():
            with torch.no_grad():
                fn(x0)

        def fwd_bwd():
            mod.zero_grad(set_to_none=True)
            xx = x0.clone().requires_grad_(need_x)
            out = fn(xx)
            (out * 0.01).sum().backward() if out.dim() else out.backward()

        return _best(fwd, repeats), _best(fwd_bwd, repeats)

    def loss(xx):
        lp = torch.log_softmax(model.lm_head(model.model.norm(xx)), -1)
        return -lp.gather(-1, ids[..., None]).mean()

    mlp = lg.mlp
    return {
        "embedding": pair(model.model.embed_tokens, lambda _: model.model.embed_tokens(ids), need_x=False),
        "rmsnorm": pair(la.input_layernorm, la.input_layernorm),
        "attention": pair(la.self_attn, lambda xx: la.self_attn(xx, position_embeddings=pe, attention_mask=None)[0]),
        "gdn": pair(lg.linear_attn, lambda xx: lg.linear_attn(xx)),
        "moe (whole block)": pair(mlp, mlp),
        "moe router (+top-k)": pair(mlp, lambda xx: mlp.gate(xx)[1]),
        "moe routed experts": pair(mlp, lambda xx: mlp.experts(xx.reshape(b * t, -1), *_routing(mlp, xx))),
        "moe shared expert": pair(mlp, lambda xx: mlp.shared_expert(xx)),
        "lm_head + loss": pair(model, loss),
        "lm_head + chunked CE": pair(model, lambda xx: torch.nn.functional.cross_entropy(
            model.lm_head(model.model.norm(xx)).reshape(-1, cfg.vocab_size), ids.reshape(-1))),
    }


def _routing(mlp, xx):
    import torch

    with torch.no_grad():
        _, w, e = mlp.gate(xx.reshape(-1, xx.shape[-1]))
    return e, w


def print_breakdown(cfg, ids_np: np.ndarray, repeats: int, skip_torch: bool) -> None:
    ours = jax_rows(cfg, ids_np, repeats)
    theirs = {} if skip_torch else in_own_process(torch_rows, cfg, ids_np, repeats)
    nan = (float("nan"), float("nan"))
    print(f"\n{'module (one layer, ms)':<32} {'jax fwd':>8} {'jax f+b':>8} {'torch fwd':>9} {'torch f+b':>9} "
          f"{'f+b / fwd':>9} {'torch/jax f+b':>13}")
    for name, (f, fb) in ours.items():
        tf, tfb = theirs.get(name, theirs.get(name.split(" (")[0], nan))
        print(f"{name:<32} {1e3 * f:>8.1f} {1e3 * fb:>8.1f} {1e3 * tf:>9.1f} {1e3 * tfb:>9.1f} {fb / f:>9.1f} "
              f"{tfb / fb:>12.2f}x")
