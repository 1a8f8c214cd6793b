"""The CLI's commands, one module each.

A command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func=<callable(args) -> int>` on it; `app.cli.COMMANDS` lists the modules. Keep heavy imports
(the engine, numba, the hub client) inside the function, so that `colibri --help` stays fast.
A command raises `engine.errors.ColibriError` for a user's mistake; `app.cli` prints it.
"""
