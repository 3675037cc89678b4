"""The network: building blocks, mixers, the layer stack, the model, the parameter layouts.

- `nn`: parameters with logical axis names, `Dense`, the zero-centred and the gated RMSNorm;
- `attention`: gated GQA attention with q/k norm and partial RoPE, and the two-stream masks;
- `gdn`: the Gated DeltaNet layer, AR and block mode (history unit, right-context conv);
- `moe`: the dropless MoE with the shared expert, its expert paths and expert parallelism;
- `layers`: one decoder layer, the repeating layer group and the `lax.scan` over groups (the layer
  stack; not to be confused with `clover_jax.decoding`, which generates text);
- `clover_model`: `CloverModel` (AR forward, caches, two-stream forward, block steps), `create_model`,
  `abstract_model`, `shift_predictions`;
- `params`: the per-layer and stacked parameter layouts as pure dicts.

May import: `clover_jax.config`, `clover_jax.parallel`, `clover_jax.yaml_config`, `pallas_kernels`.
Never `bridge`, `decoding`, `api`, `train`, `sft` (docs/architecture.md, the import rule).
Submodules are imported by full path (`from clover_jax.model.clover_model import CloverModel`); this
package re-exports nothing, so importing one room costs only what it uses.
"""
