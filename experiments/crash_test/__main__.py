"""python -m experiments.crash_test (and its writer subprocess)."""
import sys

from impress_flexgen.entrypoints.process import run_main

from .runner import PROG, main

sys.exit(run_main(PROG, main))
