"""Qt views of the desktop app, built on `app` (never on the engine's state directly).

app: QApplication setup and the main window; bridge: service events and snapshots as queued
signals; chat, conversation_list, controls, models: the panels; theme: palette and icon;
inspector: the live views of the engine; screenshots: the README's pictures.
"""
