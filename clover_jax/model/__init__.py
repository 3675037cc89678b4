"""clover_jax.model: see docs/architecture.md."""
