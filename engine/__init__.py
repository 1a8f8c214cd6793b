"""Colibri's inference core: formats, model families, generation. numpy + numba, nothing above it."""

__version__ = "0.1.0"
