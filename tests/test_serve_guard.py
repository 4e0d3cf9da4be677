"""The server against hostile clients: body limit, length check before tokenising, strict
types, role injection, API keys and tenants' namespaces, the stats block and cached tokens
off by default, /metrics behind its own key, slow connections and the connection cap."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import time

import httpx2
import pytest

from impress_flexgen.config import ServiceConfig
from impress_flexgen.entrypoints.openai.guard import ServerOptions, namespace
from impress_flexgen.entrypoints.openai.server import background_server, parse_args, server_options
from impress_flexgen.service import Service
from tests.helpers.fixtures import llama_tiny_runtime as runtime  # noqa: F401 - a fixture

MODEL = "llama-tiny"


@pytest.fixture(scope="module")
def service(runtime, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with Service(ServiceConfig(model=MODEL, store_root=root, queue_size=8),
                 runtime=runtime) as s:
        yield s


@pytest.mark.slow
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


@pytest.mark.slow
def test_keys_and_salts_reach_the_engine_as_namespaces(service):
    seen = []
    start = service.engine.add_request   # the engine's entry: every request is added there

    def spy(request, *a, **kw):
        seen.append(request.namespace)
        return start(request, *a, **kw)

    service.engine.add_request = spy
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
        service.engine.add_request = start
    assert seen == [namespace("k1", None), namespace("k2", None), namespace("k1", "s"),
                    namespace("k1", "s"), ""]
    assert len(set(seen)) == 4 and all(len(n) == 32 for n in seen[:4])


@pytest.mark.slow
def test_stats_block_only_with_the_flag_and_cached_tokens_with_a_flag_or_a_salt(service):
    prompt = "It is a truth universally acknowledged " * 6
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with background_server(service) as url:
        plain = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
        again = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
        with httpx2.stream("POST", url + "/v1/completions", timeout=30, json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        salted = [httpx2.post(url + "/v1/completions", json={**body, "cache_salt": "s"},
                              timeout=30).json() for _ in range(2)]
    with background_server(service, options=ServerOptions(cache_stats=True,
                                                          prompt_tokens_details=True)) as url:
        shown = httpx2.post(url + "/v1/completions", json=body, timeout=30).json()
    assert "impress_flexgen" not in plain and "impress_flexgen" not in again
    # By default the usage says nothing of the store: the second request's equals the first's.
    assert plain["usage"] == again["usage"] and again["usage"]["prompt_tokens_details"] is None
    assert json.loads(events[-1][len("data: "):])["usage"]["prompt_tokens_details"] is None
    # A salted namespace is the salt holder's own: its cached tokens are told.
    assert salted[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = shown["impress_flexgen"]
    assert shown["usage"]["prompt_tokens_details"]["cached_tokens"] == stats["cached_tokens"]
    assert stats["cached_tokens"] == stats["matched_tokens"] > 0


@pytest.mark.slow
def test_a_right_and_a_wrong_guess_of_a_stored_prompt_get_the_same_usage(service):
    from experiments.abuse_test import Abuse

    with background_server(service) as open_url, background_server(
            service, options=ServerOptions(prompt_tokens_details=True)) as details:
        assert Abuse(service, open_url, "", details).membership_usage() is None


def test_metrics_need_their_own_key_once_keys_are_set(service):
    def scrape(url, key=None, path="/metrics"):
        return httpx2.get(url + path, timeout=10, headers={"authorization": f"Bearer {key}"}
                          if key else {})

    with background_server(service, options=ServerOptions(api_keys=("k1",))) as url:
        closed = [scrape(url).status_code, scrape(url, "k1").status_code]
    with background_server(service, options=ServerOptions(api_keys=("k1",),
                                                          metrics_key="m")) as url:
        keyed = [scrape(url).status_code, scrape(url, "k1").status_code]
        opened = scrape(url, "m")
        models = scrape(url, "m", "/v1/models").status_code
    with background_server(service, options=ServerOptions(metrics_key="m")) as url:
        alone = [scrape(url).status_code, scrape(url, "m").status_code]
    with background_server(service) as url:
        open_ = scrape(url).status_code
    assert closed == [401, 401] and keyed == [401, 401] and alone == [401, 200]
    assert opened.status_code == 200 and "impress_flexgen_prompt_tokens_total" in opened.text
    assert models == 401 and open_ == 200     # the metrics key is no API key; no keys: open


def test_a_slow_client_is_closed_within_the_read_deadline(service):
    from experiments.abuse_connections import SMALL, open_slow, wait_closed

    with background_server(service, options=ServerOptions(read_timeout_s=1.0)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        t0 = time.monotonic()
        slow = open_slow(host, int(port), 3)    # nothing, half the headers, half a body
        answered = httpx2.post(url + "/v1/completions", json=SMALL, timeout=30)
        # A slow client that is in time is served.
        body = json.dumps(SMALL).encode()
        late = socket.create_connection((host, int(port)))
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:9])
        time.sleep(0.5)
        late.sendall(body[9:])
        late.settimeout(30)
        served = late.recv(12)
        late.close()
        still, answers = wait_closed(slow, t0 + 3.0)
        took = time.monotonic() - t0
    assert answered.status_code == 200 and served == b"HTTP/1.1 200"
    assert not still and 1.0 <= took < 3.0
    assert sorted(a[:12] for a in answers) == [b"", b"HTTP/1.1 408", b"HTTP/1.1 408"]


def test_connections_past_the_cap_do_not_lock_out_a_normal_request(service):
    from experiments.abuse_connections import SMALL, open_slow, wait_closed

    options = ServerOptions(read_timeout_s=60.0, max_connections=4)
    with background_server(service, options=options) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        slow = open_slow(host, int(port), 12)
        t0 = time.monotonic()
        r = httpx2.post(url + "/v1/completions", json=SMALL, timeout=30)
        took = time.monotonic() - t0
        still, answers = wait_closed(slow, time.monotonic() + 1.0)
        for s in still:
            s.close()
    # Answered long before any deadline: slow connections past the cap gave way to it.
    assert r.status_code == 200 and took < 10
    assert len(still) <= 4 and len(answers) >= 8


def test_accept_errors_are_logged_at_most_once_a_second():
    from impress_flexgen.entrypoints.openai.http import Acceptor, ThrottledLog

    class OutOfDescriptors:
        """A listening socket whose accept() fails as a process out of descriptors does."""

        def __init__(self, sock):
            self.sock, self.tries = sock, 0

        def fileno(self):
            return self.sock.fileno()

        def setblocking(self, flag):
            self.sock.setblocking(flag)

        def accept(self):
            self.tries += 1
            raise OSError(errno.EMFILE, "Too many open files")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lines = []
    logger = logging.getLogger("test.accept")
    logger.addHandler(Keep())
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())   # one waits: readable
    sock = OutOfDescriptors(listener)
    loop = asyncio.new_event_loop()
    try:
        acceptor = Acceptor(loop, sock, None, cap=100, notes=ThrottledLog(logger))
        acceptor.start()
        loop.run_until_complete(asyncio.sleep(1.4))
        acceptor.stop()
    finally:
        loop.close()
        client.close()
        listener.close()
    assert sock.tries >= 4                  # it keeps trying, a few times a second
    assert len(lines) == 2 and all("Too many open files" in x for x in lines)
    assert "more like it" in lines[-1]


def test_another_tenants_prefix_cannot_be_probed(service):
    from experiments.abuse_test import KEYS, Abuse, store_isolates

    if not store_isolates(service):
        pytest.skip("the store does not keep namespaces apart")
    with background_server(service) as open_url, \
            background_server(service, options=ServerOptions(api_keys=KEYS)) as keyed:
        assert Abuse(service, open_url, keyed).tenant_probe() is None


def test_serve_flags_for_the_guard():
    args = parse_args(["--api-key", "a", "--api-key", "b", "--max-body-bytes", "4096",
                       "--return-cache-stats", "--enable-prompt-tokens-details",
                       "--metrics-key", "m", "--read-timeout-s", "2.5",
                       "--max-connections", "40", "--backlog", "16"])
    assert server_options(args) == ServerOptions(4096, ("a", "b"), True, 2.5, 40, 16, True,
                                                 "m")
    assert server_options(parse_args([])) == ServerOptions()
    for bad in (["--api-key", " "], ["--api-key", "a", "--metrics-key", "a"],
                ["--read-timeout-s", "0"], ["--max-connections", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_half_sent_connections_than_descriptors_leave_the_server_answering():
    """The server program under a 256-descriptor limit and 300 half-sent connections: a
    normal request is answered, nothing logs "Too many open files", all are closed."""
    from experiments.abuse_connections import descriptor_flood

    assert descriptor_flood() is None
