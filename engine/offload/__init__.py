"""Streaming MoE expert weights from disk under a memory budget: reader threads, caching policy."""
