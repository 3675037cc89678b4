"""The streamed, sharded start-up of the SFT recipe (`sft.init_params`) against the whole-tree path
it replaces (`init_state_host`: `load_params` on the host, then `init_train_state` shards it), on 8
simulated devices (tests/conftest.py) and a tiny 4-layer model stacked in 2 groups of 2 layers.

For the HF dir in both expert layouts (hub: fused experts in bf16, AR -> block mode with the Clover
params filled; save_pretrained: per-expert fp32, also into bf16 params) and for the Orbax params
checkpoints (AR and block mode): every leaf of the train state (params, Adam moments, step, rng)
is equal bit for bit, in the same sharding, and the streamed params equal `load_params` placed with
`device_put`. The streamed path never reads the whole tree (the whole-tree readers are made to fail)
and reads the Orbax items sharded; mismatched checkpoints fail with a ConfigError naming the place.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from clover_jax.bridge import convert
from clover_jax.bridge import params_checkpoint as pc
from clover_jax.parallel import sharding as sh
from clover_jax.yaml_config import ConfigError
from sft import init_params as ip
from sft.recipe import bare_setup
from tests.hf_fixtures import make_hf_model, write_fused_hub, write_save_pretrained


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_params")
    model = make_hf_model(seed=0)
    hub = write_fused_hub(model, root / "hub")  # bf16, fused experts, AR (qwen)
    per_expert = write_save_pretrained(model, root / "per_expert")  # fp32, per-expert tensors
    from clover_jax.api import load_hf, save_hf

    cfg, m = load_hf(hub, mode="block", bd_alpha_init=1.5)  # non-default Clover scalars survive the trip
    clover = save_hf(m, cfg, root / "clover", format="clover", dtype=None)
    return {"hub": hub, "per_expert": per_expert, "clover": clover,
            "orbax_ar": convert.convert_hf_to_orbax(hub, root / "orbax_ar"),
            "orbax_block": convert.convert_hf_to_orbax(clover, root / "orbax_block")}


def make_setup(kind: str, path: Path, param_dtype: str = "float32", **overrides):
    """`sft.recipe.bare_setup`: the checkpoint's model in block mode on fsdp 2 x expert 2 x tensor 2."""
    from dataclasses import replace

    from sft.config import ModelSpec, SFTConfig

    cfg = SFTConfig(model=ModelSpec(overrides=overrides, seed=0), mesh=sh.MeshConfig(fsdp=2, expert=2, tensor=2))
    cfg = replace(cfg, train=replace(cfg.train, param_dtype=param_dtype, seed=3, steps=10))
    return bare_setup(cfg, kind, path)


def assert_identical(new, ref) -> None:
    """Same tree, and every leaf the same dtype, bytes and sharding."""
    fn, fr = jax.tree_util.tree_leaves_with_path(new), jax.tree_util.tree_leaves_with_path(ref)
    assert jax.tree.structure(new) == jax.tree.structure(ref)
    for (path, a), (_, b) in zip(fn, fr):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (where, a.sharding, b.sharding)
        ha, hb = np.asarray(a), np.asarray(b)
        assert ha.tobytes() == hb.tobytes(), where


@pytest.mark.parametrize("name,param_dtype", [("hub", "float32"), ("per_expert", "bfloat16"), ("orbax_ar", "float32"),
                                              ("orbax_block", "float32")])
def test_streamed_init_equals_whole_tree_init(dirs, name, param_dtype, monkeypatch):
    kind = "orbax" if name.startswith("orbax") else "hf"
    setup = make_setup(kind, dirs[name], param_dtype)
    assert setup.model_cfg.mode == "block" and setup.model_cfg.num_groups == 2 == setup.model_cfg.group_size
    ref_params = jax.device_put(load := ip.load_params(kind, setup.init_path, setup.model_cfg, 0),
                                setup.param_shardings)
    ref_state = ip.init_state_host(setup)
    del load
    with monkeypatch.context() as mp:  # the whole-tree readers, host item reads, host fetches fail
        for target, attr in ((convert, "read_hf"), (pc, "load_params_checkpoint"),
                             (pc.ParamsCheckpoint, "read_layer"), (pc.ParamsCheckpoint, "read_global"),
                             (jax, "device_get")):
            mp.setattr(target, attr, _boom)
        params = ip.stream_params(kind, setup.init_path, setup.model_cfg, setup.param_shardings)
        assert_identical(params, ref_params)
        state = setup.init_state()
    assert_identical(state, ref_state)
    # the expert weights really are split over the mesh, and the Clover params are in place
    wo = state.params["groups"]["layer_0"]["moe"]["wo"]
    assert len(wo.sharding.device_set) == 8 and wo.addressable_shards[0].data.shape[1] < wo.shape[1]
    scal = np.asarray(state.params["groups"]["layer_0"]["gdn"]["bd_gdn_softmax_scalars"])
    # alpha: the clover dir's own (bd_alpha_init=1.5 when written), else the init value sqrt(dk = 8)
    np.testing.assert_allclose(scal[..., 0], 1.5 if name == "orbax_block" else np.sqrt(8), rtol=1e-6)


def _boom(*a, **k):
    raise AssertionError("the streamed init read a whole tree, a host item, or fetched to the host")


def test_mismatched_checkpoint_fails_naming_it(dirs):
    # fewer layers than the checkpoint
    setup = make_setup("orbax", dirs["orbax_ar"], num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"orbax_ar has 4 layers, the model 2"):
        ip.stream_params("orbax", setup.init_path, setup.model_cfg, setup.param_shardings)
    # another expert width: the first mis-shaped param of the first layer read, with both shapes
    setup = make_setup("orbax", dirs["orbax_ar"], moe_intermediate_size=8)
    with pytest.raises(ConfigError, match=r"orbax_ar layer 0 param 'moe\.wi_gate' has shape \(4, 32, 16\), "
                                          r"the model wants \(4, 32, 8\)"):
        ip.stream_params("orbax", setup.init_path, setup.model_cfg, setup.param_shardings)
