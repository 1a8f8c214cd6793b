"""What a user runs: the CLI, settings, model management; built on `engine`."""

from engine import __version__

__all__ = ["__version__"]
