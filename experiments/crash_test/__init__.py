"""Crash, corruption and disk-full torture test of the prefix KV store.

    python -m experiments.crash_test                          # every class, >= 200 iterations
    python -m experiments.crash_test --quick --json out.json  # fewer, under 2 minutes
    python -m experiments.crash_test --iterations 200 --dir /mnt/nvme/crash-test
    python -m experiments.crash_test --only power_loss,sqlite_damage

Small shapes (4 layers, 2 KV heads of 32, chunks of 16 tokens), an int4-probe and an
fp16-probe store alternately. KV is regenerated from token ids (kv.py), so any process can
check bits. Each fault class (faults/<class>.py, whose docstring says what it injects and
what must hold) counts: injected; detected (the store refused or reported it: CorruptNode,
UserError, StoreFull, a dropped node); harmless (everything read back bit-exact anyway);
served_wrong (KV that differs, not reported); lost (a committed prefix gone without a
reason). Classes, in the order run: kill, power_loss, crash_recovery, crash_eviction,
crash_quarantine, corruption, torn_write, io_error, capacity, enospc, fsync, sqlite_full,
sqlite_damage, tiers.

Layout: registry.py (a fault class registers itself with @fault), runner.py (arguments,
the run, the summary), writer.py (the subprocess that is killed) and kills.py (killing it,
checking what it leaves), readback.py (reading a store back), damage.py, crash_loop.py and
write_faults.py (loops shared by several classes), fake_os.py (stand-ins for `os`), and
patching.py: the harness's one reach into the store's internals (where `os` and the
durable write are replaced).

Exit status 0 only when no fault class has served_wrong or lost, no orphan remains after
recovery, every injected fault is detected or harmless and no other failure was recorded
(a writer dying on its own, a node reading back wrong, a store over its capacity). Also
reported without failing: CorruptNode raised by a reorder in the writer (a reorder racing
another).

--json writes "faults" ({class: {injected, detected, harmless, served_wrong, lost}}),
"served_wrong", "lost" and "orphans" (= "orphans_after_recovery"), "iterations" (every
injected fault of every class), the kill loop's "committed", the corruption, capacity and
ENOSPC totals, and per class details (timings, failures) under "details".
"""
from __future__ import annotations

from .kv import (C, FORMATS, SHAPE, Prefixes, expected_bits, kv_from_bits, store_config,
                 tensor_bits, token_kv)
from .readback import check_node, files_on_disk, orphans, prefix_exact, read_prefix
from .runner import PARTS, PROG, main

__all__ = ["C", "FORMATS", "PARTS", "PROG", "SHAPE", "Prefixes", "check_node",
           "expected_bits", "files_on_disk", "kv_from_bits", "main", "orphans",
           "prefix_exact", "read_prefix", "store_config", "tensor_bits", "token_kv"]
