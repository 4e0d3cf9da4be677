"""What several test modules share: deterministic KV and chunk payloads (kv.py), prompt
token ids (ids.py), fixtures (fixtures.py: import one into a module to use it there)."""
