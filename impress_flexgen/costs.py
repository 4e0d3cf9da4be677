"""Moved to impress_flexgen.planner.costs; this name is the same module (old imports work)."""
import sys

from .planner import costs as _costs

sys.modules[__name__] = _costs
