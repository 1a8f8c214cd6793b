"""Measurements: decode, KV cache, offload, evaluation, and random checkpoints to measure on."""
