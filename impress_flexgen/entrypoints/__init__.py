"""The `impress-flexgen` command: one program, three jobs.

    impress-flexgen run   [flags]   # the main job, request files, plain generation
    impress-flexgen serve [flags]   # the OpenAI-compatible server
    impress-flexgen verify [flags]  # greedy output against transformers on the same weights

Each subcommand takes exactly the flags of `python -m impress_flexgen.<job>`. The package's
programs live here, apart from what they drive: run.py (with its modes workload.py,
batch.py, generate.py), openai_server.py (routes in openai_app.py), verify.py; args.py holds
the shared flags and process.py the exit statuses. No module outside this package imports
it (the old module paths impress_flexgen.run, serve, verify and cli forward here).
"""
from __future__ import annotations

import sys

JOBS = ("run", "serve", "verify")
USAGE = "usage: impress-flexgen {run,serve,verify} [flags]   (impress-flexgen JOB --help)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    job, rest = argv[0], argv[1:]
    if job not in JOBS:
        print(f"impress-flexgen: unknown job '{job}'; choose one of: {', '.join(JOBS)}",
              file=sys.stderr)
        return 2
    from .process import run_main

    # Imported on demand: each job's module pulls in torch and FlexGen.
    if job == "run":
        from .run import main as job_main
    elif job == "serve":
        from .openai.server import main as job_main
    else:
        from .verify import main as job_main
    return run_main(f"impress-flexgen {job}", job_main, rest)


if __name__ == "__main__":
    sys.exit(main())
