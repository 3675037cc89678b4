"""clover_jax.bridge: see docs/architecture.md."""
