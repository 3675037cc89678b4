"""SFT data pipeline: agent-mix sources -> canonical chat records -> rendered documents with the
assistant loss mask -> block-aligned packed rows -> batches (docs/design.md 3.1, 3.3, 6).

Modules: ``config`` (DataConfig / SourceConfig), ``records`` (canonical schema, DataError),
``readers`` (files, globs, datasets), ``converters`` (one per source schema), ``sources`` (open +
validate + split), ``render`` (chat template + loss mask), ``packing`` (block-aligned packer),
``pipeline`` (Grain mixing, checkpointable batch iterator), ``synthetic`` (our agent traces).

``SFTData`` and ``PackedBatchIterator`` load ``pipeline`` (and with it Grain) on first use: the model,
the step and the configs import this package, and run where Grain is not installed (the GPU check's
device image has none).
"""

from typing import TYPE_CHECKING, Any

from sft.data.config import DataConfig, FilterConfig, SourceConfig, block_align_for
from sft.data.records import DataError, normalize_record
from sft.data.render import ChatRenderer, Doc
from sft.data.synthetic import generate_records, write_jsonl

if TYPE_CHECKING:
    from sft.data.pipeline import PackedBatchIterator, SFTData

_PIPELINE_NAMES = ("PackedBatchIterator", "SFTData")


def __getattr__(name: str) -> Any:
    if name in _PIPELINE_NAMES:
        from sft.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["ChatRenderer", "DataConfig", "DataError", "Doc", "FilterConfig", "PackedBatchIterator",
           "SFTData", "SourceConfig", "block_align_for", "generate_records", "normalize_record", "write_jsonl"]
