"""The fault classes, one module each. Importing a module registers its class; they run in
this order (the writer kills first, then damage on disk, then full disks and databases)."""
from . import kill, power_loss  # noqa: F401
from . import crash_recovery, crash_eviction, crash_quarantine  # noqa: F401
from . import corruption, torn_write, io_error  # noqa: F401
from . import capacity, enospc, fsync, sqlite_full, sqlite_damage  # noqa: F401
from . import tiers  # noqa: F401
