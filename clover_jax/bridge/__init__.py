"""Checkpoints and tokenizer in and out of the repository: HF safetensors <-> our params <-> Orbax.

- `safetensors_io`: streaming reader / sharded writer of safetensors (numpy only);
- `hf_rules`, `hf_keys`: the HF tensor names, both expert layouts and both prefixes, and the
  byte-exact mapping to our per-layer tree; `hf_clover`: the two Clover tensors and their shapes;
- `params_checkpoint`: our Orbax params checkpoint (one item per layer, atomic);
- `convert`: `convert_hf_to_orbax`, `export_orbax_to_hf`, `read_hf` / `write_hf` (all streamed layer
  by layer), the `<|mask|>` registration;
- `tokenizer`: the Qwen3.6 tokenizer without a hub, the chat template.

May import: `clover_jax.model` (for the parameter layouts in `model.params`), `clover_jax.config`,
`clover_jax.parallel`, `clover_jax.yaml_config`. Never `api`, `decoding`, `train`, `sft`
(docs/architecture.md). The convert path builds no JAX model: keep it so (it runs on small hosts).
"""
