"""Generation with a block-diffusion model, and the research around it.

- `generator`: `Decoder`, `DecodeConfig`, the batch layout on the block grid, request stats;
- `loops`: the jitted prefill and per-block loops of the threshold, self-speculative and AR modes;
- `rules`: token choice, confidence, the commit rule, the repetition penalty (pure jnp);
- `cli`: `launch.py generate`: opening a checkpoint, finding its tokenizer, rendering prompts;
- `metrics`: tool-call validity, BFCL-style argument match, repetition, agreement with AR;
- `calibrate`, `calibrate_plots`: `launch.py calibrate`, the block-size / threshold sweeps and plots.

May import: `clover_jax.api`, `clover_jax.bridge`, `clover_jax.model`, `clover_jax.config`,
`clover_jax.parallel`, `clover_jax.yaml_config`. Never `demo`, `train`, `sft`, `launch`; the one
exception today (calibrate's synthetic eval records from `sft.data.synthetic`) is listed in
`tests/test_import_rule.py` (docs/architecture.md).
"""
