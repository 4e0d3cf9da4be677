"""`python -m impress_flexgen.serve`: the OpenAI-compatible server
(entrypoints/openai/server.py; its routes in entrypoints/openai/app.py). A documented
command: nothing imports this module."""
import sys

if __name__ == "__main__":
    from .entrypoints.openai.server import main
    from .entrypoints.process import run_main

    sys.exit(run_main("python -m impress_flexgen.serve", main))
