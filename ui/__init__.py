"""Qt views of the desktop app (built on `app`); the app itself lands with the GUI issue."""
