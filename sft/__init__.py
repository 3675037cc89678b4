"""sft package (lands with its issue)."""
