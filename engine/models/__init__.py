"""Model families, one module each, found through a registry keyed by the checkpoint's architecture."""
