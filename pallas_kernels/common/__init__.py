"""Shared by both op families: the kernels' cost estimates and the shard_map helper."""
