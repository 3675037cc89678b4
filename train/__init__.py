"""train package (lands with its issue)."""
