import sys

from impress_flexgen.entrypoints.process import run_main

from .main import main

sys.exit(run_main("python -m experiments.planner", main))
