"""Generation defaults for every entry point (the server, request files)."""
MAX_TOKENS = 256
TEMPERATURE = 1.0
TOP_P = 1.0
