"""Generation: samplers, the generator chain, batching, speculation, saved sessions."""
