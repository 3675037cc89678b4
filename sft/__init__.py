"""Masked-diffusion SFT (docs/design.md 3.3): ``data`` (sources -> chat rendering -> block-aligned
packing -> batches), ``noise`` (per-block levels, complementary masks, block-size draw), ``loss``
(chunked-vocabulary CE at masked positions, weighting, normalisation, lb and AR terms), ``config``
(the YAML recipe, `SFTConfig`), ``recipe`` (`run_sft`: init, data, mesh, loop, eval, export)."""
