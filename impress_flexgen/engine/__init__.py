"""The serving engine: one request, from radix match to generated tokens.

    engine = Engine(runtime, store, make_policy("impress"))
    response = engine.serve(Request(prefix_ids, query_ids, max_new_tokens=8))

engine.py     the request's steps (start, step, finish; serve does all three)
runner.py     the prefill's layer loop over FlexGen's weight buffers
prefix_kv.py  a layer's stored prefix KV as the policy's plan chooses it
attention.py  new tokens over the kept prefix plus themselves
canonical.py  an exact policy's calls of a pass: stored and recomputed KV the same bits
family.py     the per-family layer math (OPT, Llama), the model's KV shape, probe heads
assemble.py   the one way to build policy + store + tiers + engine (assemble)
"""
from ..request import Request, RequestStats, Response
from .assemble import (Stack, StoreSpec, assemble, make_serving_policy, open_store,
                       start_engine)
from .attention import attend
from .engine import Engine, TierSizes, _Relay
from .family import FamilyMath, model_shape, probe_setup

__all__ = ["Engine", "FamilyMath", "Request", "RequestStats", "Response", "Stack", "StoreSpec",
           "TierSizes", "assemble", "attend", "make_serving_policy", "model_shape", "open_store",
           "probe_setup", "start_engine"]
