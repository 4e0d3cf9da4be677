"""`python -m impress_flexgen.verify`: our runtime against transformers, token for token
(entrypoints/verify.py). A documented command: nothing imports this module."""
import sys

if __name__ == "__main__":
    from .entrypoints.process import run_main
    from .entrypoints.verify import main

    sys.exit(run_main("python -m impress_flexgen.verify", main))
