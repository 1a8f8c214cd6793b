"""Helpers the tests share: reference checkpoints, GGUF writing, tiny chat models, Qt fixtures."""
