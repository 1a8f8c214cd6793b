"""The fused decode step: one token through every layer in one parallel region."""
