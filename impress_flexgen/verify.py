"""`python -m impress_flexgen.verify`: our runtime against transformers, token for token
(entrypoints/verify.py)."""
import sys

from .entrypoints.verify import compare, main, parse_args  # noqa: F401

if __name__ == "__main__":
    from .entrypoints.process import run_main

    sys.exit(run_main("python -m impress_flexgen.verify", main))
