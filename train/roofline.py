"""Roofline prediction of a train step per chip from its compiled cost (`train.hlo_cost`): the time
the step needs at the chip's peak bf16 FLOP/s, at its HBM bandwidth and at its interconnect
bandwidth, whichever is longest (the three are assumed to overlap perfectly; the real step is
slower). A PREDICTION from the program's shapes, never a measurement.

Chips (per chip; ICI / NVLink: the bidirectional bandwidth of all of a chip's links together):

| chip | bf16 dense TFLOP/s | HBM GB/s | ICI GB/s | HBM GiB |
|---|---|---|---|---|
| v5p  | 459 | 2765 | 1200 | 95 |
| v5e  | 197 |  819 |  400 | 16 |
| v6e  | 918 | 1638 |  800 | 32 |
| H100 (SXM) | 989 | 3350 | 900 | 80 GB |
| H200 (SXM) | 989 | 4800 | 900 | 141 GB |

Sources: Google Cloud TPU system architecture pages, cloud.google.com/tpu/docs/v5p, /v5e, /v6e
(peak bf16, HBM bandwidth, ICI bandwidth per chip: 4800 / 1600 / 3200 Gbps per direction);
NVIDIA H100 and H200 Tensor Core GPU datasheets, nvidia.com/en-us/data-center/h100 and /h200
(BF16 Tensor Core 1,979 TFLOP/s is quoted with 2:4 sparsity, dense is half; HBM3 3.35 TB/s,
HBM3e 4.8 TB/s; NVLink 900 GB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHIPS", "Chip", "Roofline", "roofline"]


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, all links, both directions


CHIPS = {
    "v5p": Chip("v5p", 459e12, 2765e9, 1200e9),
    "v5e": Chip("v5e", 197e12, 819e9, 400e9),
    "v6e": Chip("v6e", 918e12, 1638e9, 800e9),
    "h100": Chip("H100 SXM", 989e12, 3350e9, 900e9),
    "h200": Chip("H200 SXM", 989e12, 4800e9, 900e9),
}


@dataclass(frozen=True)
class Roofline:
    """Per-chip times (s) of one step at each bound, and what they give."""

    chip: Chip
    compute_s: float
    hbm_s: float
    ici_s: float
    tokens_per_step: float  # all chips together
    chips: int
    model_flops: float  # all chips together (the FLOPs MFU counts)

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.ici_s)

    @property
    def bound(self) -> str:
        return max((self.compute_s, "compute"), (self.hbm_s, "HBM bandwidth"), (self.ici_s, "interconnect"))[1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the slice's peak, at the predicted step time."""
        return self.model_flops / (self.step_s * self.chips * self.chip.peak_flops) if self.step_s > 0 else 0.0

    def lines(self) -> list[str]:
        ms = lambda s: f"{1e3 * s:,.1f} ms"  # noqa: E731
        return [f"  roofline on {self.chip.name} (a PREDICTION from the compiled program's FLOPs and bytes at the "
                f"chip's peaks, not a measurement; real steps are slower):",
                f"    compute {ms(self.compute_s)} (at {self.chip.peak_flops / 1e12:.0f} TFLOP/s) | HBM {ms(self.hbm_s)} "
                f"(at {self.chip.hbm_bandwidth / 1e9:.0f} GB/s) | interconnect {ms(self.ici_s)} "
                f"(at {self.chip.ici_bandwidth / 1e9:.0f} GB/s)",
                f"    step >= {ms(self.step_s)}, bound by {self.bound}: {self.tokens_per_s:,.0f} tokens/s "
                f"({self.tokens_per_s / self.chips:,.0f}/chip), MFU <= {100 * self.mfu:.1f}%"]

    def as_dict(self) -> dict:
        return {"chip": self.chip.name, "compute_s": self.compute_s, "hbm_s": self.hbm_s, "ici_s": self.ici_s,
                "step_s": self.step_s, "bound": self.bound, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "note": "roofline prediction, not a measurement"}


def roofline(chip: str | Chip, *, flops: float, hbm_bytes: float, ici_bytes: float, tokens_per_step: float,
             chips: int, model_flops: float) -> Roofline:
    """`flops`, `hbm_bytes`, `ici_bytes`: per chip per step (the executed work, e.g. from
    `train.hlo_cost`); `model_flops`, `tokens_per_step`: the whole slice's."""
    c = chip if isinstance(chip, Chip) else CHIPS[chip.lower()]
    return Roofline(c, flops / c.peak_flops, hbm_bytes / c.hbm_bandwidth, ici_bytes / c.ici_bandwidth,
                    tokens_per_step, chips, model_flops)
