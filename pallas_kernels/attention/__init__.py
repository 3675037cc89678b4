"""Attention of the two training streams: ops, reference, spans, splash, flash."""
