"""The masked-diffusion SFT recipe: `python launch.py sft --config F [k=v ...]` (docs/design.md 3.3, 6).

Flow of `run_sft(cfg)`:

1. model config: from `model.init_from` (HF config.json, or an Orbax params checkpoint's config) or
   `model.preset`, plus the overrides, in block mode; the embedded default first writes a random
   `preset` checkpoint at `init_from` when it is missing (`model.generate_missing`);
2. the mask token: the checkpoint's `mask_token_id`, or `<|mask|>` added to its tokenizer (the first
   free id, an unused embedding row of Qwen3.6: 248077), checked against the vocabulary;
3. data (before any weight is read, so bad input fails fast): `sft.data.SFTData` with
   `block_align` = lcm(data.block_align, model block sizes);
4. mesh (`mesh`, over the first `devices` devices), shardings of params / optimizer state / batch;
5. the train step per block size (multi-size training draws one per step on the host,
   `sft.noise.draw_block_size`, or follows `model.block_size_schedule`), AOT-compiled; FLOPs per
   step (for MFU) from XLA's cost analysis of the lowering with the layers unrolled
   (`SFTSetup.step_flops`);
6. `train.loop.run`: resume from `checkpoint.dir` when it holds a checkpoint (then the initial
   weights are never read), eval every `train.eval_every` steps on the held-out split at fixed noise
   levels (and block decoding of held-out prompts: `eval.decode`, `sft.decode_eval`), periodic /
   final / SIGTERM checkpoints, metrics.jsonl + console + wandb;
7. at the end: the HF export (`sft.export`; `export.dir`, default ``<run_dir>/hf_export``), a loss summary (first vs last 100 logged steps, train
   and held-out) in ``<run_dir>/summary.json`` and a loss plot ``<run_dir>/loss.png`` (with decode
   evals also ``decode.png``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from clover_jax.parallel import sharding as sh
from pallas_kernels.context.split import check_context_split
from pallas_kernels.context.layout import pieces as context_pieces
from clover_jax.config import ModelConfig
from clover_jax.model.clover_model import abstract_model, check_block_aligned, create_model, model_to_params
from clover_jax.yaml_config import ConfigError, to_tree
from sft.config import RESUME_MUST_MATCH, ModelSpec, SFTConfig, check_data_root, model_config_from
from sft.data import block_align_for
from sft.decode_eval import decode_line, decode_summary, plot_decode, with_decode_eval
from sft.init_params import init_state, load_params  # noqa: F401  (load_params: re-exported)
from sft.lora import describe, frozen_dtype, optimizer_config, train_model_config
from sft.loss import make_sft_loss
from sft.noise import check_block_size_schedule, draw_block_size, scheduled_block_size
from sft.summary import loss_summary, plot_losses

if TYPE_CHECKING:  # the pipeline (Grain) loads when a run opens its data, not with the step
    from sft.data import SFTData

log = logging.getLogger(__name__)

__all__ = ["SFTResult", "SFTSetup", "bare_setup", "loss_summary", "open_data", "prepare", "run_sft"]

#: bf16 dense peak FLOP/s per chip by `device_kind` prefix (vendor numbers); else measured.
KNOWN_PEAKS = {"TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
               "TPU v6 lite": 918e12, "TPU v6e": 918e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
               "NVIDIA A100": 312e12}


# ----------------------------------------------------------------------------------------------
# model source
def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file()


def generate_init_checkpoint(cfg: SFTConfig) -> Path:
    """The embedded default's init checkpoint: a random `model.preset` model (with the model
    overrides: a smaller stack stays consistent with later loads) in AR mode, written as a hub-style
    Qwen3.6 HF dir (bf16, fused experts, `model.language_model.` prefix) with the Qwen3.6 tokenizer,
    as `launch.py demo` builds it. Written to a temp dir and renamed (never half there)."""
    from clover_jax.api import save_hf
    from clover_jax.bridge.tokenizer import load_tokenizer, save_tokenizer

    out = Path(cfg.model.init_from)
    mcfg = model_config_from(cfg.model, None).replace(mode="ar", dtype="float32", param_dtype="float32")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = create_model(mcfg, seed=cfg.model.seed)
    save_hf(model, mcfg, tmp, format="qwen", dtype=jnp.bfloat16, expert_layout="fused",
            prefix="model.language_model.", overwrite=True)
    save_tokenizer(load_tokenizer(None), tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    log.info("wrote a random %s init checkpoint to %s", cfg.model.preset, out)
    return out


def data_source(cfg: SFTConfig) -> tuple[str, Path | None, ModelConfig | None, Path | None]:
    """(kind "hf" | "orbax" | "random", init path, the checkpoint's config, dir to take the
    tokenizer from). `model.generate_missing` writes a random init only strictly inside
    `logging.run_dir` (the run's own files): a missing path elsewhere (a mistyped real checkpoint)
    is an error, never a random model trained in its place."""
    spec = cfg.model
    if spec.init_from is None:
        return "random", None, None, None
    p = Path(spec.init_from)
    if not p.exists() and spec.generate_missing:
        run_dir = Path(cfg.logging.run_dir)
        if p.resolve() == run_dir.resolve() or not p.resolve().is_relative_to(run_dir.resolve()):
            raise ConfigError(f"model.init_from {p} does not exist (model.generate_missing only writes under "
                              f"logging.run_dir {run_dir}; point model.init_from at an existing HF dir or Orbax "
                              f"params checkpoint, or at a new path under the run dir, e.g. {run_dir / 'init_hf'})")
        generate_init_checkpoint(cfg)
    if not p.exists():
        raise ConfigError(f"model.init_from: {p} does not exist (an HF dir with config.json or an Orbax "
                          "params checkpoint from `launch.py convert`)")
    from clover_jax.bridge.params_checkpoint import is_params_checkpoint, read_params_info

    if _is_hf_dir(p):
        return "hf", p, ModelConfig.from_hf_file(p), p
    if is_params_checkpoint(p):
        ck_cfg, info = read_params_info(p)
        src = info.get("source", {}).get("hf_dir")
        return "orbax", p, ck_cfg, Path(src) if src and (Path(src) / "tokenizer.json").is_file() else None
    raise ConfigError(f"model.init_from: {p} is neither an HF dir (no config.json) nor an Orbax params "
                      "checkpoint (no clover_ckpt.json)")


def _tokenizers(cfg: SFTConfig, tok_dir: Path | None) -> Any:
    """The data tokenizer (read-only, shared): data.tokenizer, else the init dir's, else built-in."""
    from clover_jax.bridge.tokenizer import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer or tok_dir)


def resolve_mask_token(mcfg: ModelConfig, cfg: SFTConfig, tok_dir: Path | None) -> ModelConfig:
    """`mask_token_id` set and consistent with the tokenizer (docs/design.md 3.2). The id `<|mask|>` has
    (or gets: the next free id, as `clover_jax.bridge.tokenizer.add_mask_token` assigns it, 248077 on
    Qwen3.6) must equal a configured `mask_token_id` and lie inside the embedding. The tokenizer is
    not changed here (the export adds the token to its own copy). Without a tokenizer to check (a
    vocabulary the Qwen3.6 one does not fit), a configured id is taken as given."""
    from clover_jax.bridge.convert import MASK_TOKEN, QWEN_TOKENIZER_SIZE

    has_tok = cfg.data.tokenizer is not None or tok_dir is not None or mcfg.vocab_size > QWEN_TOKENIZER_SIZE
    if not has_tok:
        if mcfg.mask_token_id is None:
            raise ConfigError("model.mask_token_id: not set, and there is no tokenizer to add <|mask|> to "
                              f"(vocabulary of {mcfg.vocab_size} rows)")
        return mcfg
    tok = _tokenizers(cfg, tok_dir)
    existing = tok.convert_tokens_to_ids(MASK_TOKEN)
    known = existing is not None and existing != tok.unk_token_id and tok.convert_ids_to_tokens(existing) == MASK_TOKEN
    mask_id = int(existing) if known else len(tok)
    if mcfg.mask_token_id is not None and mcfg.mask_token_id != mask_id:
        how = "has" if known else "would get (the next free id)"
        raise ConfigError(f"model.mask_token_id: {mcfg.mask_token_id}, but {MASK_TOKEN} {how} id {mask_id} in the "
                          "tokenizer; leave mask_token_id unset or make them agree")
    if not 0 <= mask_id < mcfg.vocab_size:
        raise ConfigError(f"model.mask_token_id: {MASK_TOKEN} would get id {mask_id}, outside the embedding "
                          f"[0, {mcfg.vocab_size})")
    if mcfg.mask_token_id is None:
        log.info("registered %s as token %d (an unused embedding row)", MASK_TOKEN, mask_id)
    return mcfg.replace(mask_token_id=mask_id)


# ----------------------------------------------------------------------------------------------
# setup
@dataclass
class SFTSetup:
    """Everything `run_sft` builds before the loop (tests build steps from it directly)."""

    cfg: SFTConfig
    model_cfg: ModelConfig
    kind: str
    init_path: Path | None
    tok_dir: Path | None
    data: SFTData
    mesh: Any
    graphdef: Any
    optimizer: Any
    param_shardings: Any
    state_shardings: Any
    abstract_state: Any

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.model_cfg.block_sizes

    def put_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host batch -> global arrays, rows over the mesh's batch axes (multi-process: each process
        passes its own rows)."""
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if v.ndim == 0:
                out[k] = jax.device_put(v, NamedSharding(self.mesh, P()))
                continue
            global_shape = (v.shape[0] * jax.process_count(),) + v.shape[1:]
            s = sh.batch_sharding(self.mesh, shape=global_shape)
            out[k] = jax.make_array_from_process_local_data(s, v, global_shape)
        return out

    @property
    def end_pad_id(self) -> int:
        """The target of the slots after a response's end (`noise.after_end: pad`): the data's pad id.
        An abstract setup (`launch.py compile`) has no data: the model's pad (or first EOS) id stands
        in, since the id is a constant of the program and any id compiles the same step."""
        if self.data is not None:
            return int(self.data.pad_id)
        m = self.model_cfg
        eos = m.eos_token_id[0] if isinstance(m.eos_token_id, tuple) else m.eos_token_id
        pad = m.pad_token_id if m.pad_token_id is not None else eos
        if pad is None:
            raise ValueError("SFTSetup without data needs model pad_token_id or eos_token_id for noise.after_end: pad")
        return int(pad)

    def loss_fn(self, block_size: int) -> Callable:
        c = self.cfg
        lb = c.loss.lb_coef if c.loss.lb_coef is not None else self.model_cfg.router_aux_loss_coef
        return make_sft_loss(self.graphdef, block_size=block_size, mask_token_id=int(self.model_cfg.mask_token_id),
                             noise=c.noise, loss=c.loss, lb_coef=lb, end_pad_id=self.end_pad_id)

    @property
    def compute_dtype(self) -> str | None:
        return None if self.model_cfg.dtype == self.cfg.train.param_dtype else self.model_cfg.dtype

    def make_step(self, block_size: int) -> Callable:
        from train.step import make_train_step

        replicated = NamedSharding(self.mesh, P())
        # the options of the platform this step compiles for (a TPU topology's under `launch.py compile`)
        platform = self.mesh.devices.flat[0].platform
        return make_train_step(self.loss_fn(block_size), self.optimizer, micro_batches=self.cfg.train.micro_batches,
                               compute_dtype=self.compute_dtype, out_shardings=(self.state_shardings, replicated),
                               on_nonfinite=self.cfg.train.on_nonfinite,
                               compiler_options=self.cfg.train.compiler_options.get(platform))

    def step_flops(self, block_size: int, abstract_batch: Any) -> float | None:
        """XLA's FLOP count of one train step (`cost_analysis` of the lowering, no compile) with the
        layer stack unrolled: XLA counts a loop body once, so a scanned stack would count one layer
        group. The loops inside a layer (GDN chunk sweep, CE chunks) still count once: a lower bound.
        The micro-batch accumulation is a scan too: its body (one micro-batch) is scaled by their count."""
        graphdef = nnx.split(abstract_model(self.model_cfg.replace(scan_layers=False)))[0]
        lowered = replace(self, graphdef=graphdef).make_step(block_size).lower(self.abstract_state, abstract_batch)
        flops = _cost_flops(lowered)
        return None if flops is None else flops * self.cfg.train.micro_batches

    def init_state(self) -> Any:
        """The fresh train state on the mesh (reads the initial weights one layer at a time:
        `sft.init_params.init_state`)."""
        return init_state(self)


def sharded_abstract_state(model: nnx.Module, optimizer: Any, mesh: Mesh, train_cfg: Any) -> tuple[Any, Any, Any]:
    """(param shardings, train-state shardings, abstract train state carrying those shardings) of
    `model` on `mesh`: shapes only, no weights; shared by `prepare` and `launch.py compile`."""
    from train.state import init_train_state

    p_sh = sh.param_shardings(model, mesh)
    abstract_params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                   model_to_params(model), p_sh)
    abstract_state = jax.eval_shape(lambda p: init_train_state(p, optimizer, seed=train_cfg.seed,
                                                               master_dtype=train_cfg.param_dtype,
                                                               frozen_dtype=frozen_dtype(model.cfg)), abstract_params)
    replicated = NamedSharding(mesh, P())
    state_sh = type(abstract_state)(
        params=p_sh, opt_state=sh.opt_state_shardings(abstract_state.opt_state, p_sh, mesh),
        step=replicated, rng=replicated)
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  abstract_state, state_sh)
    return p_sh, state_sh, abstract_state


def open_data(cfg: SFTConfig, mcfg: ModelConfig, tok_dir: Path | None) -> SFTData:
    """The recipe's data: `cfg.data` packed at `block_align` = lcm(data.block_align, the model's block
    sizes), tokenised with `_tokenizers`; every source checked to render (`SFTData.check_renders`),
    so a template that refuses every record fails here, before any compile."""
    from sft.data import SFTData

    align = math.lcm(cfg.data.block_align, block_align_for(mcfg.block_size))
    if cfg.data.seq_len % align:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} must be a multiple of {align} (lcm of data.block_align "
                          f"{cfg.data.block_align} and model.block_size {mcfg.block_size})")
    data = SFTData(replace(cfg.data, block_align=align), _tokenizers(cfg, tok_dir))
    data.check_renders()
    return data


def platform_scan_default(mcfg: ModelConfig, spec: ModelSpec, platform: str) -> ModelConfig:
    """The layer stack's loop for the devices the run trains on, unless the recipe sets
    `model.scan_layers`: unrolled on CPU (XLA CPU runs a scanned stack's fwd+bwd ~20% slower, and
    the small models trained there compile fast either way: bench/forward.py --scan both), scanned on
    TPU / GPU (a 40-layer unrolled program would take far longer to compile). The parameter layout is
    the same either way. `launch.py compile` (AOT for a pod) does not come through here: it scans."""
    if "scan_layers" in spec.overrides:
        return mcfg
    return mcfg.replace(scan_layers=platform != "cpu")


def run_model_config(cfg: SFTConfig, ck_cfg: ModelConfig | None, tok_dir: Path | None, *,
                     build_vocab: bool = True) -> tuple[SFTConfig, ModelConfig, Path | None]:
    """(cfg, the run's ModelConfig, tokenizer dir) from the init checkpoint's config: overrides,
    master dtype, the task vocabulary (`build_vocab` false: the one the run already wrote, as an
    export from a training checkpoint reads it), the mask token, the response alignment. Shared by
    `prepare` and `sft.train_checkpoint`, so a training checkpoint rebuilds the very config it was
    trained with. Reads no weights and no data (unless `build_vocab` builds the task vocabulary)."""
    mcfg = train_model_config(cfg, model_config_from(cfg.model, ck_cfg))
    if cfg.vocab_subset.enabled:
        from sft.task_vocab import build_task_vocab, subset_model_ids

        tok_dir = (build_task_vocab(cfg, tok_dir) if build_vocab
                   else Path(cfg.vocab_subset.dir or Path(cfg.logging.run_dir) / "tokenizer"))
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=None))  # the data reads the subset at tok_dir
        mcfg = subset_model_ids(mcfg, tok_dir, cfg.vocab_subset.pad_to)
    mcfg = resolve_mask_token(mcfg, cfg, tok_dir)
    if cfg.model.block_size_schedule is not None:  # the sizes may have come from the checkpoint
        check_block_size_schedule(cfg.model.block_size_schedule, seq_len=cfg.data.seq_len,
                                  block_sizes=mcfg.block_sizes)
    # the checkpoint and its export say how responses were laid out (the decoder pads prompts to
    # match): the packing alignment `open_data` uses
    align = math.lcm(cfg.data.block_align, block_align_for(mcfg.block_size))
    return cfg, mcfg.replace(response_block_align=align if cfg.data.align_responses == "block" else 0), tok_dir


def prepare(cfg: SFTConfig) -> SFTSetup:
    """Steps 1-4 of the module docstring (no weights read, nothing trained)."""
    from train.optimizer import build_optimizer

    check_data_root(cfg)  # before the init checkpoint is read or written
    kind, path, ck_cfg, tok_dir = data_source(cfg)
    cfg, mcfg, tok_dir = run_model_config(cfg, ck_cfg, tok_dir)
    data = open_data(cfg, mcfg, tok_dir)
    devices = jax.devices()[: cfg.devices] if cfg.devices else jax.devices()
    if cfg.devices and len(devices) < cfg.devices:
        raise ConfigError(f"devices: {cfg.devices} requested, {len(devices)} available")
    mcfg = platform_scan_default(mcfg, cfg.model, devices[0].platform)
    try:
        mesh = sh.make_mesh(cfg.mesh, devices)
        check_context_split(cfg.data.seq_len, dict(mesh.shape)["context"], mcfg.block_sizes, mcfg.gdn_chunk_size,
                            mcfg.linear_conv_kernel_dim, layout=mcfg.context_layout,
                            pieces=context_pieces(mcfg.context_layout))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model = abstract_model(mcfg)
    graphdef, _ = nnx.split(model)
    optimizer = build_optimizer(optimizer_config(cfg), cfg.train.steps)
    p_sh, state_sh, abstract_state = sharded_abstract_state(model, optimizer, mesh, cfg.train)
    return SFTSetup(cfg=cfg, model_cfg=mcfg, kind=kind, init_path=path, tok_dir=tok_dir, data=data, mesh=mesh,
                    graphdef=graphdef, optimizer=optimizer, param_shardings=p_sh, state_shardings=state_sh,
                    abstract_state=abstract_state)


def bare_setup(cfg: SFTConfig, kind: str, path: str | Path, devices: list[Any] | None = None) -> SFTSetup:
    """An `SFTSetup` for the checkpoint at `path` (``kind`` "hf" / "orbax") without data, as
    `prepare` builds one (the checkpoint's model config in block mode with `cfg.model`'s
    overrides and `train.param_dtype`, the mesh over `devices`, the optimizer, the shardings), for
    tools and tests that only start the state; no tokenizer or mask token is resolved."""
    from clover_jax.bridge.params_checkpoint import read_params_info
    from train.optimizer import build_optimizer

    base = ModelConfig.from_hf_file(Path(path)) if kind == "hf" else read_params_info(path)[0]
    mcfg = train_model_config(cfg, model_config_from(cfg.model, base))
    mesh = sh.make_mesh(cfg.mesh, list(devices or jax.devices()))
    model = abstract_model(mcfg)
    opt = build_optimizer(optimizer_config(cfg), cfg.train.steps)
    p_sh, state_sh, abstract_state = sharded_abstract_state(model, opt, mesh, cfg.train)
    return SFTSetup(cfg=cfg, model_cfg=mcfg, kind=kind, init_path=Path(path), tok_dir=None, data=None, mesh=mesh,
                    graphdef=None, optimizer=opt, param_shardings=p_sh, state_shardings=state_sh,
                    abstract_state=abstract_state)


# ----------------------------------------------------------------------------------------------
# steps, data, eval
class _DeviceBatches:
    """The packed-batch iterator, checked for block alignment and placed on the mesh."""

    def __init__(self, setup: SFTSetup, it: Any):
        self.setup, self.it = setup, it
        self.align = setup.data.cfg.block_align

    def __iter__(self) -> "_DeviceBatches":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        b = next(self.it)
        check_block_aligned(b["segment_ids"], self.align)
        return self.setup.put_batch(b)

    def get_state(self) -> dict[str, Any]:
        return self.it.get_state()


class BlockSizeSteps:
    """The step of multi-size training: block size of update s = `draw_block_size(sizes, seed, s)`,
    or with `model.block_size_schedule` the size of its stage at s (`scheduled_block_size`), each
    size AOT-compiled once (its own static shapes). The host keeps the update count (read from the
    state once), so the choice never waits for the device, and a resume continues the sequence."""

    def __init__(self, setup: SFTSetup, abstract_batch: Any):
        self.setup, self.abstract_batch = setup, abstract_batch
        self.sizes = setup.block_sizes
        self.schedule = setup.cfg.model.block_size_schedule
        self._compiled: dict[int, Any] = {}
        self._next: int | None = None

    def compiled(self, block_size: int) -> Any:
        if block_size not in self._compiled:
            log.info("compiling the train step for block size %d", block_size)
            t0 = time.perf_counter()
            self._compiled[block_size] = self.setup.make_step(block_size).lower(
                self.setup.abstract_state, self.abstract_batch).compile()
            log.info("compiled the train step for block size %d in %.1f s", block_size, time.perf_counter() - t0)
        return self._compiled[block_size]

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        if self._next is None:
            self._next = int(jax.device_get(state.step))
        train = self.setup.cfg.train
        bk = (scheduled_block_size(self.schedule, train.steps, self._next) if self.schedule
              else draw_block_size(self.sizes, train.seed, self._next))
        self._next += 1
        new_state, metrics = self.compiled(bk)(state, batch)
        if len(self.sizes) > 1:
            metrics = {**metrics, "block_size": bk}
        return new_state, metrics


def _cost_flops(compiled: Any) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    f = (ca or {}).get("flops")
    return float(f) if f and f > 0 else None


def peak_flops(cfg: SFTConfig, devices: list[Any]) -> float:
    """Peak FLOP/s of all `devices` together: the config, a known chip's bf16 peak, or (CPU) a
    measured fp32 matmul rate."""
    if cfg.peak_flops_per_device:
        return cfg.peak_flops_per_device * len(devices)
    kind = getattr(devices[0], "device_kind", "")
    for prefix, peak in KNOWN_PEAKS.items():
        if kind.startswith(prefix):
            return peak * len(devices)
    n = 1024
    a = jax.device_put(jnp.ones((n, n), jnp.float32), devices[0])
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a))
        best = min(best, time.perf_counter() - t0)
    # host "devices" share the CPU: their peak together is one measurement, not one per device
    return 2 * n**3 / best * (1 if devices[0].platform == "cpu" else len(devices))


def make_eval_fn(setup: SFTSetup) -> Callable[[Any], dict[str, float]] | None:
    """eval_fn(state) for the loop, or None without an eval split / eval_every. ``ce_t<t>`` is the
    masked CE with every block at level t and no complementary copy (`make_sft_loss` with
    ``noise_t``): the masks of that level only."""
    from train.step import evaluate, make_eval_step

    cfg = setup.cfg
    if not cfg.train.eval_every or setup.data.eval_docs is None:
        return None
    host = []
    for b in setup.data.eval_iterator():
        host.append(b)
        if len(host) >= cfg.eval.max_batches:
            break
    bk = cfg.eval.block_size or setup.block_sizes[0]
    if cfg.data.seq_len % bk:
        raise ConfigError(f"eval.block_size {bk} does not divide data.seq_len {cfg.data.seq_len}")
    step = make_eval_step(setup.loss_fn(bk), compute_dtype=setup.compute_dtype)
    per_t = {t: [setup.put_batch({**b, "noise_t": np.float32(t)}) for b in host] for t in cfg.eval.t_values}

    def eval_fn(state: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, batches in per_t.items():
            m = evaluate(step, state.params, batches, steps=len(batches), seed=cfg.train.seed)
            out[f"ce_t{t:g}"], out[f"acc_t{t:g}"] = m["ce"], m["acc"]
        out["loss"] = float(np.mean([out[f"ce_t{t:g}"] for t in per_t]))
        return out

    return eval_fn


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SFTResult:
    step: int
    preempted: bool
    resumed_from: int | None
    export_dir: Path | None
    summary: dict[str, Any]
    nonfinite_step: int | None = None  # stopped on a non-finite loss / gradient there (nothing exported)


def run_sft(cfg: SFTConfig, *, on_step: Callable | None = None, on_checkpoint: Callable | None = None,
            print_fn: Callable[[str], None] = print) -> SFTResult:
    """The recipe (module docstring). `on_step(step, state, metrics)` / `on_checkpoint(step, state)`
    go to `train.loop.run`."""
    from sft.export import check_export_target, export_params
    from sft.remote import localize
    from train.loop import run

    t_start = time.perf_counter()
    cfg, remote_outputs = localize(cfg)  # gs://... inputs staged here, outputs mirrored locally
    check_export_target(cfg)  # a folder the export may not replace fails now, not after training
    setup = prepare(cfg)
    if cfg.export.adapters:  # an adapter export that would fail fails now, not after training
        from sft.adapter_export import check_adapter_export
        from train.optimizer import param_paths

        check_adapter_export(cfg, jax.tree.leaves(param_paths(setup.abstract_state.params)))
    mcfg, run_dir = setup.model_cfg, Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stats = setup.data.load_stats()
    print_fn(f"model: {setup.kind} {setup.init_path or cfg.model.preset}  hidden {mcfg.hidden_size}, "
             f"{mcfg.num_hidden_layers} layers, {mcfg.num_experts} experts, vocab {mcfg.vocab_size}, block "
             f"{mcfg.block_size}, mask token {mcfg.mask_token_id}; mesh {dict(setup.mesh.shape)}")
    for name, s in stats.items():
        print_fn(f"data {name}: {s['kept']} records ({s['train']} train / {s['eval']} eval), "
                 f"{s['bad']} bad skipped, {s['filtered']} filtered")
    rows = cfg.data.batch_size
    print_fn(f"batch: {rows} packed rows x {cfg.data.seq_len} tokens per step (x{cfg.noise.copies} noisy copies "
             f"in the model), {cfg.train.micro_batches} micro-batch(es); {cfg.train.steps} steps")
    if cfg.lora.enabled:
        print_fn(describe(setup.abstract_state.params, setup.optimizer, setup.cfg.lora.dropout))
    abstract_batch = {k: jax.ShapeDtypeStruct((rows, cfg.data.seq_len), dt,
                                              sharding=sh.batch_sharding(setup.mesh, shape=(rows, cfg.data.seq_len)))
                      for k, dt in (("input_ids", jnp.int32), ("segment_ids", jnp.int32), ("positions", jnp.int32),
                                    ("loss_mask", jnp.bool_))}
    # the peak first: its one-device matmul cannot run under the mesh context of use_sharding
    peak = peak_flops(cfg, list(setup.mesh.devices.flat))
    with sh.use_sharding(setup.mesh):
        steps = BlockSizeSteps(setup, abstract_batch)
        flops = setup.step_flops(setup.block_sizes[0], abstract_batch) if cfg.count_flops else None
        steps.compiled(setup.block_sizes[0])
        eval_fn = with_decode_eval(setup, make_eval_fn(setup))  # + eval.decode (sft.decode_eval)
        shard = (jax.process_index(), jax.process_count())

        def batches(data_state: dict[str, Any] | None) -> _DeviceBatches:
            it = setup.data.train_iterator(*shard)
            if data_state:
                it.set_state(data_state)
            return _DeviceBatches(setup, it)

        res = run(steps, setup.init_state, batches, config=cfg.trainer_config(), eval_fn=eval_fn,
                  run_config=to_tree(cfg), flops_per_step=flops, peak_flops=peak, on_step=on_step,
                  on_checkpoint=on_checkpoint, abstract_state=setup.abstract_state, resume_must_match=RESUME_MUST_MATCH,
                  resume_defaults=to_tree(SFTConfig()),
                  params_mask=setup.optimizer.trainable_mask(setup.abstract_state.params))
    export_dir = None
    finished = not res.preempted and res.nonfinite_step is None and res.step >= cfg.train.steps
    if cfg.export_dir and finished:
        t0 = time.perf_counter()
        export_dir = export_params(setup.cfg, setup.model_cfg, setup.tok_dir, res.state.params, res.step)
        print_fn(f"exported {cfg.export.format} HF checkpoint to {export_dir} in {time.perf_counter() - t0:.1f} s")
    if cfg.export.adapters and finished:
        from sft.adapter_export import export_adapter

        t0 = time.perf_counter()
        adapter = export_adapter(setup.cfg, setup.model_cfg, res.state.params, res.step)
        print_fn(f"exported the PEFT LoRA adapter to {adapter} in {time.perf_counter() - t0:.1f} s")
    from train.logging import METRICS_FILE

    mpath = run_dir / METRICS_FILE
    summary = loss_summary(mpath) if mpath.exists() else {}
    summary.update(wall_s=time.perf_counter() - t_start, steps=res.step, preempted=res.preempted,
                   resumed_from=res.resumed_from, flops_per_step=flops, peak_flops=peak, nonfinite_step=res.nonfinite_step)
    summary.update(decode_summary(mpath) if mpath.exists() else {})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if mpath.exists():
        plot_losses(mpath, run_dir / "loss.png")
        plot_decode(mpath, run_dir / "decode.png")  # only with decode evals
    if "train_loss_first" in summary:
        w = summary["window_steps"]
        line = (f"train loss, mean of the first {w} vs last {w} steps: {summary['train_loss_first']:.4f} -> "
                f"{summary['train_loss_last']:.4f}")
        if "eval_loss_first" in summary:
            line += (f"; held-out masked CE (evals in those windows): {summary['eval_loss_first']:.4f} -> "
                     f"{summary['eval_loss_last']:.4f}")
        print_fn(line)
    if decode_line(summary):
        print_fn(decode_line(summary))
    print_fn(f"run dir {run_dir} (metrics.jsonl, summary.json, loss.png); wall {summary['wall_s']:.0f} s")
    remote_outputs.publish(export=export_dir is not None, print_fn=print_fn)
    return SFTResult(step=res.step, preempted=res.preempted, resumed_from=res.resumed_from, export_dir=export_dir,
                     summary=summary, nonfinite_step=res.nonfinite_step)
