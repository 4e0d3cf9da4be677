"""The command line's shared pieces, importable from here as before: entrypoints/args.py
(the parser, argument types, shared flags) and entrypoints/process.py (exit statuses)."""
from .entrypoints.args import (PLACEMENT_HELP, ArgumentParser, add_model_args,  # noqa: F401
                               add_serving_args, check_serving_args, choose_list, dtype_arg,
                               finite_float, int_range, placement_arg, remote_url_arg,
                               write_json)
from .entrypoints.process import Terminated, run_main, sigterm_exits  # noqa: F401
