"""`colibri atlas`: which experts the probe topics use, and the probe prompts themselves."""
