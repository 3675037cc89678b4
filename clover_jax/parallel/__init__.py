"""clover_jax.parallel: see docs/architecture.md."""
