"""Experiments and benchmarks built on radixkv."""
