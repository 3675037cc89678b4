"""The Clover block-diffusion tensors of an HF checkpoint <-> our block-mode GDN params (numpy).

Two public namings exist (docs/design.md 2.2 says which source shows which; both are read, `split`
is written by default, `packed` on request). Per GDN layer (``L = P + "layers.{i}.linear_attn."``;
docs/design.md 2.2, 3.2 B and C):

======================================  ===============================  ==================================
HF tensor                               HF shape (accepted on read)      ours
======================================  ===============================  ==================================
``split`` (llama.cpp's Clover converter, architecture ``CloverMoeModelLM``)
``L bd_softmax_logit_scale``            [nv] (also [nv, 1], [])          bd_gdn_softmax_scalars[:, 0] alpha
``L bd_softmax_history_bias``           [nv] (also [nv, 1], [])          bd_gdn_softmax_scalars[:, 1] beta
``L bd_softmax_history_c``              [nv] (also [nv, 1], [])          bd_gdn_softmax_scalars[:, 2] gamma
``L conv_right_weight``                 [C, K-1] (also [C, 1, K-1])      gdn.conv_{q,k,v}.right [K-1, part]
``packed`` (the names a press article read in the released files)
``L bd_gdn_softmax_scalars``            [nv, 3] (also [nv], [nv, 2])     gdn.bd_gdn_softmax_scalars [nv, 3]
``L bd_gdn_conv_right_weight``          [C, K-1] (also [C, 1, K-1])      gdn.conv_{q,k,v}.right [K-1, part]
======================================  ===============================  ==================================

The split scalars' meaning is OUR READING of their names (logit_scale = the in-block q.k logit scale
alpha, history_bias = the history unit's logit bias beta, history_c = the coefficient gamma of the
log block-size term); no public source shows their formula. A split scalar given as [] (one value
for every head) is broadcast, and says so. Packed columns are (alpha, beta, gamma) per value head; an
[nv] tensor is beta only and [nv, 2] is (beta, gamma): the missing columns come from the config's
init values (logged, naming the tensor). The right-context conv is fused over the C = 2*key_dim + value_dim conv channels in the
q | k | v row order of ``conv1d.weight``; ``weight[c, d-1] = right[d-1, c]`` (tap d-1 multiplies
the token d positions ahead). Anything else fails with `HFMappingError` naming tensor, shape and
the accepted shapes.

Either side may lack them: a Qwen checkpoint read in block mode gets the init values (alpha, beta,
gamma from the config, right taps zero), a Clover checkpoint read in AR mode drops them, an AR
model written as Clover writes the init values, a block model written as Qwen drops them. The
mapping itself is in `hf_keys` (rule kinds ``bd_scalars`` / ``bd_right``); this module holds the
array work and the log lines. Everything here is small ([nv, 3], [C, K-1]): read whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from clover_jax.config import LINEAR, ModelConfig
from clover_jax.bridge.safetensors_io import CheckpointError

logger = logging.getLogger("clover_jax.bridge.hf_keys")  # one logger for the whole HF mapping

SCALARS = "bd_gdn_softmax_scalars"  # the packed naming
CONV_RIGHT = "bd_gdn_conv_right_weight"
SPLIT_SCALARS = ("bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c")  # alpha, beta, gamma
SPLIT_CONV_RIGHT = "conv_right_weight"
SPLIT, PACKED = "split", "packed"
NAMINGS = (SPLIT, PACKED)
OUR_SCALARS = "gdn.bd_gdn_softmax_scalars"
OUR_RIGHT = ("gdn.conv_q.right", "gdn.conv_k.right", "gdn.conv_v.right")

Shape = tuple[int, ...]


class HFMappingError(CheckpointError):
    """HF tensors that do not fit the config: the message names the HF key (and shapes).

    A `CheckpointError` (so a `ValueError`): callers catch one type for every bad-checkpoint case."""


def our_shapes(cfg: ModelConfig) -> tuple[Shape, tuple[Shape, Shape, Shape]]:
    """Block-mode shapes of ours: scalars [nv, 3] and the right taps [K-1, part] of q, k, v
    (whatever `cfg.mode` is: an AR model written as Clover needs them too)."""
    k1 = cfg.linear_conv_kernel_dim - 1
    return (cfg.linear_num_value_heads, 3), ((k1, cfg.gdn_key_dim), (k1, cfg.gdn_key_dim), (k1, cfg.gdn_value_dim))


def scalar_names(naming: str) -> tuple[str, ...]:
    """The HF names (after ``linear_attn.``) of the scalars in ``naming``: one packed, three split."""
    if naming not in NAMINGS:
        raise HFMappingError(f"unknown Clover tensor naming {naming!r} (supported: {', '.join(NAMINGS)})")
    return (SCALARS,) if naming == PACKED else SPLIT_SCALARS


def right_name(naming: str) -> str:
    """The HF name (after ``linear_attn.``) of the right-context conv in ``naming``."""
    scalar_names(naming)  # validates the naming
    return CONV_RIGHT if naming == PACKED else SPLIT_CONV_RIGHT


def hf_scalar_shapes(nv: int, naming: str = PACKED) -> list[Shape]:
    """Accepted HF shapes of one scalars tensor in ``naming``, canonical first."""
    return [(nv, 3), (nv,), (nv, 2)] if naming == PACKED else [(nv,), (nv, 1), ()]


def hf_right_shapes(right_shapes: Sequence[Shape]) -> list[Shape]:
    """Accepted HF shapes of the right-context conv, canonical first."""
    c, k1 = sum(s[1] for s in right_shapes), right_shapes[0][0]
    return [(c, k1), (c, 1, k1)]


def shape_error(key: str, got: Sequence[int], accepted: Sequence[Shape], source: str) -> HFMappingError:
    alt = ", ".join(str(tuple(s)) for s in accepted)
    return HFMappingError(
        f"{source}: tensor {key!r} has shape {tuple(got)}, expected {tuple(accepted[0])}"
        + (f" (accepted shapes: {alt})" if len(accepted) > 1 else "")
    )


def check_shape(key: str, got: Sequence[int], accepted: Sequence[Shape], source: str) -> None:
    if tuple(got) not in [tuple(s) for s in accepted]:
        raise shape_error(key, got, accepted, source)


# --------------------------------------------------------------------------------------------
# HF -> ours
# --------------------------------------------------------------------------------------------


def init_scalars(nv: int, init: Sequence[float]) -> np.ndarray:
    """[nv, 3] fp32, every row (alpha, beta, gamma) = `init`."""
    return np.tile(np.asarray(init, np.float32), (nv, 1))


def split_scalars_to_ours(keys: Sequence[str], arrs: Sequence[np.ndarray], nv: int, source: str) -> np.ndarray:
    """The three split HF scalars (alpha, beta, gamma; each [nv], [nv, 1] or [] broadcast over the
    heads, which is logged) -> ours [nv, 3] in their common dtype."""
    cols = []
    for key, arr in zip(keys, arrs):
        check_shape(key, arr.shape, hf_scalar_shapes(nv, SPLIT), source)
        if arr.ndim == 0:
            logger.info("%s: %r is one value for all %d heads; broadcast", source, key, nv)
        cols.append(np.broadcast_to(arr.reshape(-1), (nv,)))
    return np.stack(cols, axis=1)


def init_right(right_shapes: Sequence[Shape], dtype: np.dtype) -> list[np.ndarray]:
    return [np.zeros(s, dtype) for s in right_shapes]


def scalars_to_ours(key: str, arr: np.ndarray, nv: int, init: Sequence[float], source: str) -> np.ndarray:
    """HF scalars [nv, 3] (as is), [nv] (beta) or [nv, 2] (beta, gamma) -> ours [nv, 3]. A partial
    tensor becomes fp32 with the missing columns from `init`, and says so."""
    check_shape(key, arr.shape, hf_scalar_shapes(nv), source)
    if arr.shape == (nv, 3):
        return arr
    out = init_scalars(nv, init)
    if arr.ndim == 1:
        out[:, 1] = arr
        what = "beta only; alpha = %g, gamma = %g from the config's init values" % (init[0], init[2])
    else:
        out[:, 1:] = arr
        what = "(beta, gamma); alpha = %g from the config's init values" % init[0]
    logger.info("%s: %r has shape %s = %s -> [%d, 3] (alpha, beta, gamma) fp32",
                source, key, tuple(arr.shape), what, nv)
    return out


def right_to_ours(key: str, arr: np.ndarray, right_shapes: Sequence[Shape], source: str) -> list[np.ndarray]:
    """HF [C, K-1] or [C, 1, K-1] -> ours [K-1, part] x3 (C-contiguous copies, rows q | k | v)."""
    check_shape(key, arr.shape, hf_right_shapes(right_shapes), source)
    a = arr[:, 0, :] if arr.ndim == 3 else arr
    out, start = [], 0
    for s in right_shapes:
        out.append(np.ascontiguousarray(a[start:start + s[1]].T))
        start += s[1]
    return out


# --------------------------------------------------------------------------------------------
# ours -> HF
# --------------------------------------------------------------------------------------------


def scalars_to_split(scalars: np.ndarray) -> list[np.ndarray]:
    """Ours [nv, 3] -> the split HF tensors [nv] x3 (alpha, beta, gamma; C-contiguous)."""
    return [np.ascontiguousarray(scalars[:, j]) for j in range(3)]


def right_to_hf(rights: Sequence[np.ndarray]) -> np.ndarray:
    """Ours [K-1, part] x3 -> HF [C, K-1] (C-contiguous)."""
    return np.ascontiguousarray(np.concatenate([r.T for r in rights], axis=0))


# --------------------------------------------------------------------------------------------
# log lines (one per checkpoint, not per layer)
# --------------------------------------------------------------------------------------------


def _counts(cfg: ModelConfig, naming: str) -> tuple[int, int]:
    n = sum(t == LINEAR for t in cfg.layer_types)
    return (len(scalar_names(naming)) + 1) * n, n


def _names_text(naming: str) -> str:
    return ", ".join(scalar_names(naming) + (right_name(naming),))


def _init_text(cfg: ModelConfig) -> str:
    a, b, g = cfg.bd_scalar_init
    return f"(alpha, beta, gamma) = ({a:g}, {b:g}, {g:g}), right-context conv taps = 0"


def log_read(cfg: ModelConfig, hf_has_clover: bool, source: str, naming: str = SPLIT) -> None:
    """The one line a read gets when the checkpoint and `cfg.mode` disagree about the Clover tensors
    (``naming``: the checkpoint's, when it has them)."""
    n, layers = _counts(cfg, naming)
    if not layers:
        return
    if cfg.mode == "block" and not hf_has_clover:
        logger.info("%s: no Clover block-diffusion tensors in the checkpoint; mode='block' fills the Clover "
                    "parameters of %d GDN layers with their init values: %s", source, layers, _init_text(cfg))
    elif cfg.mode == "ar" and hf_has_clover:
        logger.info("%s: mode='ar' drops the checkpoint's %d Clover block-diffusion tensors (%s of "
                    "%d GDN layers): AR mode is the clean stream only", source, n, _names_text(naming), layers)


def log_write(cfg: ModelConfig, hf_has_clover: bool, out: str, naming: str = SPLIT) -> None:
    """The one line a write gets when the format and `cfg.mode` disagree about the Clover tensors
    (``naming``: the export's, when it writes them)."""
    n, layers = _counts(cfg, naming)
    if not layers:
        return
    if cfg.mode == "ar" and hf_has_clover:
        logger.info("%s: the model is in AR mode; the clover export writes its %d Clover tensors (%s of %d "
                    "GDN layers) at their init values: %s", out, n, _names_text(naming), layers, _init_text(cfg))
    elif cfg.mode == "block" and not hf_has_clover:
        logger.info("%s: the qwen format drops the model's Clover block-diffusion parameters of %d GDN layers",
                    out, layers)
