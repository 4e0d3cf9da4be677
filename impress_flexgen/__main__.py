"""`python -m impress_flexgen run|serve|verify [flags]`: the same as `impress-flexgen`."""
import sys

from .entrypoints import main

sys.exit(main())
