"""Cloud paths (gs://, s3://, anything `etils.epath` opens) for the SFT recipe's inputs and outputs.

A pod's hosts read the data and the init checkpoint from a bucket and write the run there. The
recipe's code reads and writes local files; remote paths are staged at its edges (`localize` at the
start of `run_sft`, `RemoteOutputs.publish` at its end), with `train.remote`'s primitives:

- inputs: `data_root` and `model.init_from` given as URIs are copied once per host into
  ``<staging_dir>/<what>-<hash of the URI>`` (`train.remote.stage_in`: never trusted half-copied,
  reused by a resumed run);
- `checkpoint.dir`: Orbax reads and writes URIs itself (`train.checkpoint` hands it an
  `epath.Path`), so checkpoints go straight to the bucket; a remote `logging.run_dir` without an
  explicit `checkpoint.dir` puts them at ``<run_dir>/checkpoints`` there, and a preempted run
  resumes from the bucket on any host;
- outputs: a remote `logging.run_dir` is written to a local mirror (the run's files already in the
  bucket, e.g. the metrics of the steps before a preemption, are pulled into it first, so a resumed
  run appends to the same metrics.jsonl) and uploaded by process 0 when the run ends or is
  preempted, ``summary.json`` last; a remote `export.dir` is exported locally and uploaded with
  ``config.json`` last.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from train.remote import copy_tree, epath_of, is_remote, join, publish, stage_in, staging_path

if TYPE_CHECKING:
    from sft.config import SFTConfig

__all__ = ["RemoteOutputs", "localize"]


@dataclass(frozen=True)
class RemoteOutputs:
    """Where the localized run's outputs go: (local dir, URI) of the run dir and of the export."""

    run_dir: tuple[str, str] | None = None
    export_dir: tuple[str, str] | None = None

    def publish(self, *, run: bool = True, export: bool = True, print_fn: Callable[[str], None] = print) -> None:
        """Upload (process 0 only: every host holds the same files)."""
        import jax

        if jax.process_index() != 0:
            return
        for on, pair, last in ((export, self.export_dir, ("config.json",)), (run, self.run_dir, ("summary.json",))):
            if on and pair is not None and Path(pair[0]).is_dir():
                n = publish(pair[0], pair[1], last=last, skip=("checkpoints",))
                print_fn(f"uploaded {n} files {pair[0]} -> {pair[1]}")


def _map_sources(data, uri: str, local: str):
    """`data` with source paths (and `hf.data_files`) under ``uri`` moved to the staged copy."""
    prefix = uri.rstrip("/") + "/"
    move = lambda p: local + "/" + p[len(prefix):] if isinstance(p, str) and p.startswith(prefix) else p  # noqa: E731
    sources = []
    for src in data.sources:
        hf = src.hf
        if hf is not None and "data_files" in hf:
            files = hf["data_files"]
            hf = {**hf, "data_files": [move(f) for f in files] if isinstance(files, list) else move(files)}
        sources.append(dataclasses.replace(src, path=move(src.path), hf=hf))
    return dataclasses.replace(data, sources=tuple(sources))


def localize(cfg: "SFTConfig") -> tuple["SFTConfig", RemoteOutputs]:
    """``cfg`` with its remote paths replaced by local ones (inputs staged now, the run dir's
    files pulled into its mirror), and where its outputs go (module docstring). A config without
    URIs comes back unchanged with empty outputs."""
    staging, rep = cfg.staging_dir, {}
    if is_remote(cfg.data_root):
        root = str(stage_in(cfg.data_root, staging, "data_root"))
        rep["data_root"], rep["data"] = root, _map_sources(cfg.data, cfg.data_root, root)
    model = cfg.model
    if is_remote(model.init_from):
        model = dataclasses.replace(model, init_from=str(stage_in(model.init_from, staging, "model.init_from")))
    run_pair = export_pair = None
    logging, checkpoint, export = cfg.logging, cfg.checkpoint, cfg.export
    if export.enabled and export.dir is None and is_remote(logging.run_dir):
        export = dataclasses.replace(export, dir=cfg.export_dir)  # <run_dir URI>/hf_export, uploaded as the export
    if is_remote(logging.run_dir):
        uri = logging.run_dir
        local = staging_path(staging, "run", uri)
        local.mkdir(parents=True, exist_ok=True)
        src = epath_of(uri)
        if src.exists():  # a resumed run: its metrics, summary, tokenizer subset (checkpoints stay remote)
            copy_tree(src, local, skip=("checkpoints",))
        if checkpoint.dir is None:
            checkpoint = dataclasses.replace(checkpoint, dir=join(uri, "checkpoints"))
        logging = dataclasses.replace(logging, run_dir=str(local))
        run_pair = (str(local), uri)
    if is_remote(export.dir):
        local = staging_path(staging, "export", export.dir)
        shutil.rmtree(local, ignore_errors=True)  # the export is rewritten whole at the end of a run
        export_pair = (str(local), export.dir)
        export = dataclasses.replace(export, dir=str(local), overwrite=True)
    out = dataclasses.replace(cfg, model=model, logging=logging, checkpoint=checkpoint, export=export, **rep)
    return out, RemoteOutputs(run_dir=run_pair, export_dir=export_pair)
