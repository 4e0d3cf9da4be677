"""`python -m impress_flexgen.serve`: the OpenAI-compatible server
(entrypoints/openai_server.py; its routes in entrypoints/openai_app.py)."""
import sys

from .entrypoints.openai_app import create_app  # noqa: F401
from .entrypoints.openai_server import (background_server, bind, main,  # noqa: F401
                                        parse_args, server_options)

if __name__ == "__main__":
    from .entrypoints.process import run_main

    sys.exit(run_main("python -m impress_flexgen.serve", main))
