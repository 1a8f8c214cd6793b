"""The errors the engine raises for a user's mistake: each names the problem and the fix."""

from __future__ import annotations


class ColibriError(Exception):
    """A problem a user can fix; front ends print the message without a traceback."""


class ModelFormatError(ColibriError):
    """A model file or folder is missing, truncated, inconsistent or of an unknown kind."""


class UnsupportedArchitectureError(ColibriError):
    """The checkpoint's architecture has no module in `engine.models`."""


class TokenizerError(ColibriError):
    """The tokenizer or chat template cannot be built or used."""


class GenerationError(ColibriError):
    """A request cannot be served as asked (prompt too long, bad sampling settings ...)."""
