"""Benchmarks run end to end in their quick mode."""
from __future__ import annotations

import json

from experiments import prefill_decode


def test_prefill_decode_quick(tmp_path):
    out = tmp_path / "pd.json"
    assert prefill_decode.main(["--quick", "--placement", "gpu", "--placement", "disk",
                                "--offload-dir", str(tmp_path / "off"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4  # two tiny models x two placements
    assert all(r["prefill_s"] > 0 and r["decode_s_per_token"] > 0 for r in rows)
