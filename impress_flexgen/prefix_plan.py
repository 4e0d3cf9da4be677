"""Moved to impress_flexgen.planner.planner; this name is the same module (old imports and
PrefixPlanner(engine) work)."""
import sys

from .planner import planner as _planner

sys.modules[__name__] = _planner
