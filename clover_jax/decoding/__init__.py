"""clover_jax.decoding: see docs/architecture.md."""
