"""Toy model, loss and data for the trainer tests (imported by the other test_train_* files), and the
tests of the toy's own contract: the data iterator resumes exactly from its state.

The toy is a one-layer LM: ``logits = (embed[ids] * (1 + norm.scale)) @ head.kernel + head.bias``,
trained with a masked-token-mean cross-entropy (the shape of the SFT loss: only some tokens carry
loss, and the count differs from row to row).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, DIM, SEQ = 16, 8, 6


def toy_params(seed: int = 0) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "embed": {"embedding": 0.5 * jax.random.normal(k1, (VOCAB, DIM), jnp.float32)},
        "norm": {"scale": jnp.zeros((DIM,), jnp.float32)},
        "head": {"kernel": 0.5 * jax.random.normal(k2, (DIM, VOCAB), jnp.float32),
                 "bias": jnp.zeros((VOCAB,), jnp.float32)},
    }


def toy_logits(params: dict[str, Any], ids_BT: jax.Array) -> jax.Array:
    h_BTD = jnp.take(params["embed"]["embedding"], ids_BT, axis=0) * (1.0 + params["norm"]["scale"])
    return (h_BTD @ params["head"]["kernel"] + params["head"]["bias"]).astype(jnp.float32)


def toy_loss(params: dict[str, Any], batch: dict[str, jax.Array], rng: jax.Array) -> tuple[jax.Array, dict]:
    """Masked-token-mean CE; metrics: weight (= loss tokens), accuracy over loss tokens, tokens."""
    del rng
    logits_BTV = toy_logits(params, batch["ids"])
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, batch["targets"][..., None], axis=-1)[..., 0]
    m_BT = batch["mask"].astype(jnp.float32)
    w = jnp.sum(m_BT)
    correct_BT = (jnp.argmax(logits_BTV, -1) == batch["targets"]).astype(jnp.float32)
    safe = jnp.maximum(w, 1.0)
    return jnp.sum(nll_BT * m_BT) / safe, {
        "weight": w, "accuracy": jnp.sum(correct_BT * m_BT) / safe, "tokens": jnp.asarray(m_BT.size, jnp.int32)}


def make_batch(seed: int, index: int, batch: int = 8) -> dict[str, np.ndarray]:
    """Batch `index` of the stream `seed`: random ids, a learnable target, masks whose density
    differs per row (row r keeps roughly (r % 4 + 1) / 5 of its tokens; some rows may be empty)."""
    rng = np.random.default_rng([seed, index])
    ids = rng.integers(0, VOCAB, (batch, SEQ), dtype=np.int32)
    density = (np.arange(batch) % 4 + 1)[:, None] / 5.0
    mask = (rng.random((batch, SEQ)) < density).astype(np.int32)
    return {"ids": ids, "targets": (3 * ids + 1) % VOCAB, "mask": mask}


class ToyBatches:
    """Deterministic infinite batch stream with a JSON state (`{"seed", "index"}`), as a stand-in
    for the SFT data pipeline: the state after k batches makes a fresh iterator yield batch k next."""

    def __init__(self, seed: int = 0, batch: int = 8, state: dict[str, Any] | None = None):
        self.seed, self.batch, self.index = seed, batch, 0
        if state:
            self.set_state(state)

    def __iter__(self) -> "ToyBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = make_batch(self.seed, self.index, self.batch)
        self.index += 1
        return out

    def get_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"data state is for seed {state.get('seed')}, this stream has seed {self.seed}")
        self.index = int(state["index"])


# ---------------------------------------------------------------------------------------------- tests

def test_toy_batches_resume_from_state():
    a = ToyBatches(seed=3)
    for _ in range(3):
        next(a)
    state = a.get_state()
    want = [next(a) for _ in range(2)]
    b = ToyBatches(seed=3, state=state)
    got = [next(b) for _ in range(2)]
    for w, g in zip(want, got):
        for k in w:
            np.testing.assert_array_equal(w[k], g[k])
    assert state == {"seed": 3, "index": 3}


def test_toy_masks_are_uneven_across_rows():
    # the accumulation test relies on micro-batches carrying different numbers of loss tokens
    m = make_batch(0, 0)["mask"]
    counts = [int(m[i::4].sum()) for i in range(4)]  # the strided split into 4 micro-batches
    assert len(set(counts)) >= 3, counts
