"""The engine service: the one way front ends (GUI, server) drive a model, local or remote."""
