"""Prefix-KV serving policies for the impress_flexgen runtime, one module per policy."""
