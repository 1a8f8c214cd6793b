"""Settings, paths, sizes and process setup that every command shares."""
