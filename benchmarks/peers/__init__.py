"""Runners of the peer benchmark rows (one per framework) and the report they feed."""
