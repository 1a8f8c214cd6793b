"""`colibri serve`: the HTTP server and its adapter onto the engine service."""
