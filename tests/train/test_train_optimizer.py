"""train.optimizer: schedule values (hand-computed), the weight-decay mask and the trainable subsets on
the real tiny CloverModel param paths, frozen params untouched with no optimizer state, clipping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.config import OptimizerConfig, TrainConfigError
from train.optimizer import build_optimizer, decay_mask, make_schedule, param_paths, trainable_mask
from train.state import init_train_state
from train.step import make_train_step


def _block_model_params():
    from clover_jax.config import get_preset
    from clover_jax.model.clover_model import abstract_model, model_to_params

    cfg = get_preset("tiny").replace(mode="block", mask_token_id=255)
    return model_to_params(abstract_model(cfg))  # shapes only: the paths are what matter


def _flat(tree):
    return dict(zip(jax.tree.leaves(param_paths(tree)), jax.tree.leaves(tree)))


def test_schedule_values_hand_computed():
    s = make_schedule(OptimizerConfig(lr=1.0, warmup_steps=4, decay="cosine", min_lr_ratio=0.1), total_steps=14)
    # warmup (s+1)/4; then cosine over the 10 steps 4..14 from 1 to 0.1; flat after
    want = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)),
            14: 0.1, 20: 0.1}
    for step, lr in want.items():
        assert float(s(step)) == pytest.approx(lr, rel=1e-6), step
    lin = make_schedule(OptimizerConfig(lr=2.0, warmup_steps=0, decay="linear", min_lr_ratio=0.0,
                                        decay_steps=8), total_steps=100)
    assert [float(lin(i)) for i in (0, 2, 8, 9)] == pytest.approx([2.0, 1.5, 0.0, 0.0])
    const = make_schedule(OptimizerConfig(lr=0.5, warmup_steps=2, decay="constant"), total_steps=10)
    assert [float(const(i)) for i in (0, 1, 2, 9)] == pytest.approx([0.25, 0.5, 0.5, 0.5])


def test_no_decay_mask_on_model_params():
    params = _block_model_params()
    mask = _flat(decay_mask(OptimizerConfig(), params))
    no_decay = sorted(k for k, v in mask.items() if not v)
    want = sorted(k for k in mask if k.endswith((".scale", ".A_log", ".dt_bias", ".bd_gdn_softmax_scalars")))
    assert no_decay == want and len(want) >= 8
    assert mask["embed.embedding"] and mask["groups.layer_0.gdn.in_proj_a.kernel"] and mask["groups.layer_1.moe.wo"]


def test_weight_decay_applies_only_to_decayed_params():
    # zero gradients: the Adam part is exactly 0, so the update is -lr * wd * p on decayed params only
    params = {"w": {"kernel": jnp.full((3,), 2.0)}, "norm": {"scale": jnp.full((3,), 2.0)},
              "gdn": {"A_log": jnp.full((2,), 2.0)}}
    opt = build_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5, decay="constant", clip_norm=None), 10)
    state = init_train_state(params, opt)
    new, _ = make_train_step(lambda p, b, r: (0.0 * sum(jnp.sum(x) for x in jax.tree.leaves(p)), {}), opt,
                             donate=False)(state, {"x": np.zeros((1,))})
    np.testing.assert_allclose(new.params["w"]["kernel"], 2.0 - 0.1 * 0.5 * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(new.params["norm"]["scale"], params["norm"]["scale"])
    np.testing.assert_array_equal(new.params["gdn"]["A_log"], params["gdn"]["A_log"])


def test_trainable_regex_selects_the_clover_params():
    params = _block_model_params()
    mask = _flat(trainable_mask(OptimizerConfig(trainable=("bd_gdn_", "conv_.*right")), params))
    got = sorted(k for k, v in mask.items() if v)
    want = sorted(f"groups.layer_0.gdn.{n}" for n in
                  ("bd_gdn_softmax_scalars", "conv_q.right", "conv_k.right", "conv_v.right"))
    assert got == want  # tiny: layer_0 is the GDN slot of the 2-layer group
    frozen_too = _flat(trainable_mask(OptimizerConfig(trainable=("bd_gdn_", "conv_.*right"),
                                                      frozen=(r"conv_v",)), params))
    assert sorted(k for k, v in frozen_too.items() if v) == [w for w in want if "conv_v" not in w]


def test_bad_selection_patterns_are_errors():
    params = _block_model_params()
    with pytest.raises(TrainConfigError, match=r"optimizer.trainable: pattern 'bd_gdm_' matches no param"):
        trainable_mask(OptimizerConfig(trainable=("bd_gdm_",)), params)
    with pytest.raises(TrainConfigError, match=r"optimizer.frozen: pattern 'nope' matches no param"):
        trainable_mask(OptimizerConfig(frozen=("nope",)), params)
    with pytest.raises(TrainConfigError, match="no trainable params"):
        trainable_mask(OptimizerConfig(frozen=(".",)), params)
    with pytest.raises(TrainConfigError, match=r"optimizer.no_decay: bad regex"):
        OptimizerConfig(no_decay=("(",))


def test_frozen_params_unchanged_and_hold_no_optimizer_state():
    params = {"body": {"kernel": jnp.arange(6.0).reshape(2, 3)}, "gdn": {"bd_gdn_softmax_scalars": jnp.ones((2, 3))},
              "head": {"kernel": jnp.ones((3, 2))}}
    opt = build_optimizer(OptimizerConfig(lr=0.1, trainable=("bd_gdn_", "head")), 10)
    state = init_train_state(params, opt)
    params = jax.tree.map(np.array, params)  # host copies: the step donates the state's buffers
    # Adam moments only for the trainable leaves: 6 + 6 elements each for mu and nu
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * (6 + 6)

    def loss(p, batch, rng):
        return sum(jnp.sum(jnp.sin(x) * batch["c"]) for x in jax.tree.leaves(p)), {}

    step = make_train_step(loss, opt)
    for _ in range(3):
        state, _ = step(state, {"c": jnp.ones((1,))})
    np.testing.assert_array_equal(state.params["body"]["kernel"], params["body"]["kernel"])
    assert not np.allclose(state.params["head"]["kernel"], params["head"]["kernel"])
    assert not np.allclose(state.params["gdn"]["bd_gdn_softmax_scalars"], params["gdn"]["bd_gdn_softmax_scalars"])


def test_clipping_scales_gradients_to_clip_norm():
    # one step: mu = (1 - b1) * clipped grad; grad_norm reports the norm before clipping
    params = {"a": np.zeros((4,), np.float32), "b": np.zeros((3,), np.float32)}  # host: each init copies
    g = {"a": jnp.array([3.0, 0.0, 0.0, 0.0]), "b": jnp.array([0.0, 4.0, 0.0])}  # norm 5
    opt = build_optimizer(OptimizerConfig(lr=1e-3, clip_norm=1.0, b1=0.9, weight_decay=0.0), 10)
    state = init_train_state(params, opt)
    new, m = make_train_step(lambda p, b, r: (sum(jnp.vdot(p[k], g[k]) for k in p), {}), opt)(state, {"x": jnp.zeros(1)})
    assert float(m["grad_norm"]) == pytest.approx(5.0)
    mu = [s for s in jax.tree.leaves(new.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0].mu
    np.testing.assert_allclose(mu["a"], 0.1 * g["a"] / 5.0, rtol=1e-6)
    np.testing.assert_allclose(mu["b"], 0.1 * g["b"] / 5.0, rtol=1e-6)
    # below the threshold nothing is scaled
    opt_big = build_optimizer(OptimizerConfig(lr=1e-3, clip_norm=10.0, b1=0.9), 10)
    new, _ = make_train_step(lambda p, b, r: (sum(jnp.vdot(p[k], g[k]) for k in p), {}), opt_big)(
        init_train_state(params, opt_big), {"x": jnp.zeros(1)})
    mu = [s for s in jax.tree.leaves(new.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0].mu
    np.testing.assert_allclose(mu["a"], 0.1 * g["a"], rtol=1e-6)


def test_trainer_config_from_yaml_tree():
    from clover_jax.yaml_config import ConfigError, from_tree
    from train.config import TrainerConfig

    cfg = from_tree(TrainerConfig, {
        "train": {"steps": 20, "micro_batches": 4},
        "optimizer": {"lr": 1e-4, "trainable": ["bd_gdn_", "conv_.*right"], "decay": "linear"},
        "checkpoint": {"dir": "/tmp/x", "every_steps": 5},
        "logging": {"wandb": {"mode": "disabled"}},
    })
    assert cfg.optimizer.trainable == ("bd_gdn_", "conv_.*right") and cfg.train.micro_batches == 4
    assert cfg.optimizer.no_decay[0] == r"(^|\.)scale$" and cfg.logging.wandb.mode == "disabled"
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.warmup' \(did you mean 'optimizer.warmup_steps'"):
        from_tree(TrainerConfig, {"optimizer": {"warmup": 3}})
    with pytest.raises(TrainConfigError, match=r"train.micro_batches must be >= 1"):
        from_tree(TrainerConfig, {"train": {"micro_batches": 0}})
