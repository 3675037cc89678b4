"""Multi-host on CPU: two local processes (2 CPU devices each, gloo collectives) joined by
`clover_jax.parallel.distributed.maybe_initialize` train a tiny CloverModel (AR clean stream, a GDN and an
attention layer) for 3 steps on the mesh expert=4: the batch rows split by process (each process
feeds only its own rows) and the MoE all-to-all crosses processes. The losses must equal those of
one process on one device with the same initial params and global batch. The DCN mesh
(data=2 over the processes x expert=2) is checked for its device layout (no compile).

This file is also the worker script: `python tests/parallel/test_multihost.py --worker` (env set by the test).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

STEPS, BATCH, LEN = 3, 4, 16
#: XLA's backend optimisation level 0 for the three compiles (reference and both workers): the same
#: semantics at about half the CPU compile time (as tests/sft/test_sft_recipe.py)
FAST = {"xla_backend_optimization_level": 0}


def train_losses(mesh_cfg=None) -> list[float]:
    """3 adamw steps of next-token CE + 0.01 * MoE lb loss; sharded (and EP) when `mesh_cfg` is given."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from clover_jax.parallel import distributed, sharding as sh
    from clover_jax.config import get_preset
    from clover_jax.model.clover_model import create_model, model_to_params

    cfg = get_preset("tiny").replace(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                                     moe_impl="dense")
    model = create_model(cfg, seed=0)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (BATCH, LEN)).astype(np.int32)
    tx = optax.adamw(1e-2)

    def step(params, opt_state, ids):
        def loss_fn(p):
            m = nnx.merge(graphdef, p)
            h, aux = m.hidden_states(ids)
            logp = jax.nn.log_softmax(m.logits(h)[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1)) + 0.01 * aux["lb_loss"]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if mesh_cfg is None:
        graphdef, _ = nnx.split(model)
        params = model_to_params(model)
        opt_state = tx.init(params)
        fn, batch = jax.jit(step, compiler_options=FAST), jnp.asarray(ids)
    else:
        mesh = sh.make_mesh(mesh_cfg)
        sh.shard_params(model, mesh)
        graphdef, _ = nnx.split(model)
        params = model_to_params(model)
        p_sh = sh.param_shardings(model, mesh)
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state_shardings(jax.eval_shape(tx.init, params), params, mesh))(params)
        b_sh = sh.batch_sharding(mesh, shape=ids.shape)
        rows = distributed.process_rows(b_sh, ids.shape)
        assert rows.stop - rows.start == BATCH // jax.process_count()  # each process feeds only its rows
        batch = distributed.global_batch(ids[rows], b_sh, BATCH)
        o_sh = jax.tree.map(lambda a: a.sharding, opt_state)
        fn = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, None), compiler_options=FAST)
    losses = []
    ctx = sh.use_sharding(mesh) if mesh_cfg is not None else _null()
    with ctx:
        for _ in range(STEPS):
            params, opt_state, loss = fn(params, opt_state, batch)
            losses.append(float(loss))
    return losses


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _worker() -> None:
    from clover_jax.parallel import distributed, sharding as sh

    assert distributed.maybe_initialize()
    import jax

    assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
    # DCN on the data axis: each data row of the mesh is one process's devices
    dcn = sh.make_mesh(sh.MeshConfig(data=2, fsdp=1, expert=2, dcn_data=2))
    for row in dcn.devices.reshape(2, -1):
        assert len({d.process_index for d in row}) == 1, dcn.devices
    losses = train_losses(sh.MeshConfig(data=1, fsdp=1, expert=4))  # expert all-to-all across processes
    if distributed.is_coordinator():
        print("LOSSES ep_across " + json.dumps(losses), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device():
    repo = Path(__file__).resolve().parents[2]
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid), PYTHONPATH=str(repo),
                   XLA_FLAGS="--xla_force_host_platform_device_count=2")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env, cwd=repo,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reference = train_losses(None)  # this process, one device, while the workers run
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0, f"worker failed (rc {rc}):\n{err[-3000:]}"
    import numpy as np

    got = {ln.split()[1]: json.loads(ln.split(" ", 2)[2]) for ln in outs[0][1].splitlines() if ln.startswith("LOSSES ")}
    assert set(got) == {"ep_across"}, outs[0][1]
    assert reference[-1] < reference[0]  # it trains
    for name, losses in got.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=name)


def test_detect_reads_the_launch_environment():
    from clover_jax.parallel.distributed import detect

    assert detect({}) is None
    assert detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) == "JAX_COORDINATOR_ADDRESS"
    assert detect({"SLURM_NTASKS": "1"}) is None and detect({"SLURM_NTASKS": "4"}) == "SLURM"
    assert detect({"TPU_WORKER_HOSTNAMES": "t0"}) is None
    assert detect({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}) == "TPU pod slice"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
