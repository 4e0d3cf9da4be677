"""Workloads and the runs over them that the experiments and `run --workload` report.

    workload.py  a workload: shared prefixes and queries drawn from the corpus, seeded
    runner.py    one configuration's run of a workload, and its summary (plans, bytes, KL)
    corpus.py    the public-domain texts the workload draws from (data/texts)
    texts.py     the fixed prompts of the plain generation job
"""
