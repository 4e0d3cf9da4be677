"""The generation defaults of every entry point (the server, request files): what a request that does not say applies."""
MAX_TOKENS = 256
TEMPERATURE = 1.0
TOP_P = 1.0
