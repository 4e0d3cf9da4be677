"""The server against hostile clients: body limit, length check before tokenising, strict
types, role injection, API keys and tenants' namespaces, the stats block off by default."""
from __future__ import annotations

import json

import httpx2
import pytest

from impress_flexgen.serve import background_server, parse_args, server_options
from impress_flexgen.serve_guard import ServerOptions, namespace
from impress_flexgen.config import ServiceConfig
from impress_flexgen.service import Service
from tests.helpers.fixtures import llama_tiny_runtime as runtime  # noqa: F401 - a fixture

MODEL = "llama-tiny"


@pytest.fixture(scope="module")
def service(runtime, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with Service(ServiceConfig(model=MODEL, store_root=root, queue_size=8),
                 runtime=runtime) as s:
        yield s


def test_abuse_harness_quick_passes_every_class(tmp_path):
    from experiments import abuse_test

    out = tmp_path / "abuse.json"
    code = abuse_test.main(["--quick", "--json", str(out)])
    classes = json.loads(out.read_text())["classes"]
    assert set(classes) == set(abuse_test.CLASSES)
    failed = {k: v["errors"] for k, v in classes.items() if v["failed"]}
    assert code == 0 and not failed, failed
    assert all(v["passed"] == v["rounds"] >= 1 for k, v in classes.items()
               if "missing" not in v)


def test_keys_and_salts_reach_the_engine_as_namespaces(service):
    seen = []
    start = service.engine.start      # the scheduler's entry: every request is prefilled there

    def spy(request, *a, **kw):
        seen.append(request.namespace)
        return start(request, *a, **kw)

    service.engine.start = spy
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 1}
    try:
        with background_server(service, options=ServerOptions(api_keys=("k1", "k2"))) as url:
            for key, salt in (("k1", None), ("k2", None), ("k1", "s"), ("k1", "s")):
                r = httpx2.post(url + "/v1/completions", timeout=30,
                                json={**body, **({"cache_salt": salt} if salt else {})},
                                headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            r = httpx2.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with background_server(service) as url:
            httpx2.post(url + "/v1/completions", json=body, timeout=30)
            r = httpx2.post(url + "/v1/completions", json={**body, "cache_salt": ""})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    finally:
        service.engine.start = start
    assert seen == [namespace("k1", None), namespace("k2", None), namespace("k1", "s"),
                    namespace("k1", "s"), ""]
    assert len(set(seen)) == 4 and all(len(n) == 32 for n in seen[:4])


def test_stats_block_only_with_the_flag_and_cached_tokens_always(service):
    prompt = "It is a truth universally acknowledged " * 6
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with background_server(service) as url:
        plain = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
        again = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
    with background_server(service, options=ServerOptions(cache_stats=True)) as url:
        shown = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
    assert "impress_flexgen" not in plain and "impress_flexgen" not in again
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = shown["impress_flexgen"]
    assert shown["usage"]["prompt_tokens_details"]["cached_tokens"] == stats["cached_tokens"]
    assert stats["cached_tokens"] == stats["matched_tokens"] > 0


def test_another_tenants_prefix_cannot_be_probed(service):
    from experiments.abuse_test import KEYS, Abuse, store_isolates

    if not store_isolates(service):
        pytest.skip("the store does not keep namespaces apart")
    with background_server(service) as open_url, \
            background_server(service, options=ServerOptions(api_keys=KEYS)) as keyed:
        assert Abuse(service, open_url, keyed).tenant_probe() is None


def test_serve_flags_for_the_guard():
    args = parse_args(["--api-key", "a", "--api-key", "b", "--max-body-bytes", "4096",
                       "--return-cache-stats"])
    assert server_options(args) == ServerOptions(4096, ("a", "b"), True)
    assert server_options(parse_args([])) == ServerOptions()
    with pytest.raises(SystemExit):
        parse_args(["--api-key", " "])
