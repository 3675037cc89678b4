"""Context (sequence) parallelism: the context axis, layouts, exchange, GDN and attention over shards."""
