"""Gated DeltaNet: the public ops, references, custom_vjp ops, TPU / GPU pallas_calls, chunk math."""
