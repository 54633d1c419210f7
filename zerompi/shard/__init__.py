"""Sharding a module: the pure bucket plan (layout.py), flat buffers, buckets and their per-stage
table (stages.py), gradient shards, the sharded model with its hooks, prefetch and deferred init."""
