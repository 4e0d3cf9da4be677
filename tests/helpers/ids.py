"""Prompt token ids for tests."""
from __future__ import annotations

import numpy as np


def prompt_ids(seed: int, n: int) -> list[int]:
    """n token ids in 10..39999 (ordinary vocabulary for every test model), seeded."""
    return np.random.default_rng(seed).integers(10, 40000, n).tolist()
