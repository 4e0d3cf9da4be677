"""`python -m impress_flexgen.run`: the main job, request files, plain generation
(entrypoints/run.py). A documented command: nothing imports this module."""
import sys

if __name__ == "__main__":
    from .entrypoints.process import run_main
    from .entrypoints.run import main

    sys.exit(run_main("python -m impress_flexgen.run", main))
