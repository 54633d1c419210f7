"""Tests that need a CUDA GPU; skipped, each with its reason, where there is none (README.md)."""
