"""`python -m impress_flexgen.run`: the main job, request files, plain generation
(entrypoints/run.py)."""
import sys

from .entrypoints.process import run_main  # noqa: F401
from .entrypoints.run import main, parse_args  # noqa: F401
from .store_root import STORE_ROOT_MARK, _store_name  # noqa: F401

if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.run", main))
