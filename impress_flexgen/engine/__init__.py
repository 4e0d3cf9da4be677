"""The serving engine: three objects and one loop.

    stack = assemble(runtime, make_policy("impress"), StoreSpec(directory))
    response = stack.engine.serve(Request(prefix_ids, query_ids, max_new_tokens=8))

engine.py        Engine: add_request, step (the loop), serve; retries
scheduler.py     the queues, admission, prefill passes, post-processing of picked tokens
runner.py        the layer loops (a prefill pass, a decode step) over FlexGen's weights
sequence.py      one request's record from match to last token
prefix.py        a sequence's stored prefix: opened (match, pool, plan, pin), closed (stored)
lane.py          one sequence's part of a prefill pass: its reads, its attention
prefix_kv.py     a layer's stored prefix KV as the policy's plan chooses it
layer_io.py      a layer's reads: probe keys and chunks read ahead, loads through the tiers
attention.py     prefill attention, an exact policy's canonical tiles, decode side by side
store_writer.py  the thread that stores new prefix KV behind the decode steps
family.py        the per-family layer math (OPT, Llama), the model's KV shape, probe heads
assemble.py      the one way to build policy + store + tiers + engine (assemble)
"""
from ..request import Request, RequestStats, Response
from .assemble import Stack, StoreSpec, assemble, make_serving_policy, open_store, start_engine
from .attention import attend
from .engine import Engine
from .family import FamilyMath, model_shape, probe_setup
from .scheduler import SchedulerConfig
from .sequence import Sequence

__all__ = ["Engine", "FamilyMath", "Request", "RequestStats", "Response", "SchedulerConfig",
           "Sequence", "Stack", "StoreSpec", "assemble", "attend",
           "make_serving_policy", "model_shape", "open_store", "probe_setup", "start_engine"]
