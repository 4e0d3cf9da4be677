"""The service's configuration (config.py) from the command line: every flag of `run` and
`serve`, among them --plan, --remote-tier and --disk-read-limit, parsed into one
ServiceConfig (runtime, run, tiers, store: typed parts, one tier record, no copied fields)
that reaches the engine, and the /metrics series they add. `make test`'s redis-server
step, with its hint when it cannot install one."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from impress_flexgen.config import RunConfig, ServiceConfig, StoreOptions
from impress_flexgen.entrypoints import run
from impress_flexgen.entrypoints.openai import server as serve
from impress_flexgen.entrypoints.openai.server import background_server
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.frontend import Frontend, Job
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.service import Service
from impress_flexgen.store.config import CHUNK_SIZE
from impress_flexgen.tiers import REMOTE, TierConfig
from impress_flexgen.tiers.remote import chunk_hashes, layer_key
from impress_flexgen.tiers.remote_url import redact_url
from tests.helpers.ids import prompt_ids as _ids
from tests.redis_server import RedisServer, free_port, require_redis_server

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-tiny"
GB = 1 << 30
PROG = {"run": run, "serve": serve}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    rt = Runtime(RuntimeConfig(model=MODEL, offload_dir=str(tmp_path_factory.mktemp("off"))))
    yield rt
    rt.close()


@pytest.fixture(autouse=True)
def private_cost_cache(tmp_path, monkeypatch):
    """The planner's calibration goes to this test's directory, not the user's cache."""
    monkeypatch.setenv("IMPRESS_FLEXGEN_CACHE", str(tmp_path / "cache"))


def _metrics(url: str) -> dict:
    text = httpx2.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _metric(m: dict, name: str, **labels) -> float | None:
    return m.get((f"impress_flexgen_{name}", tuple(sorted(labels.items()))))


# -- flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prog", ["run", "serve"])
def test_the_new_flags_default_to_auto_no_limit_no_pool(prog):
    args = PROG[prog].parse_args([])
    assert (args.plan, args.disk_read_limit, args.remote_tier) == ("auto", None, None)
    assert args.chunk_size == CHUNK_SIZE


@pytest.mark.parametrize("prog", ["run", "serve"])
@pytest.mark.parametrize("flags, message", [
    (["--plan", "guess"], "--plan: invalid choice: 'guess'"),
    (["--disk-read-limit", "0"], "--disk-read-limit must be positive (got 0)"),
    (["--disk-read-limit", "-5"], "--disk-read-limit must be positive"),
    (["--disk-read-limit", "nan"], "--disk-read-limit must be a finite number"),
    (["--disk-read-limit", "fast"], "invalid float value: 'fast'"),
    (["--remote-tier", "http://127.0.0.1:6379/0"], "must start with one of redis://"),
    (["--remote-tier", "redis://127.0.0.1:99999/0"], "has a bad port"),
    (["--remote-tier", "redis:///0"], "names no host"),
    (["--remote-tier", "redis://127.0.0.1:6379/zero"], "has a bad database 'zero'"),
    (["--remote-tier", ""], "url must be like redis://HOST:PORT/DB"),
])
def test_bad_values_are_one_line_and_exit_2(prog, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        PROG[prog].parse_args(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.slow
def test_a_bad_url_from_the_command_line_is_refused_before_anything_loads(tmp_path):
    r = subprocess.run([sys.executable, "-m", "impress_flexgen.serve", "--remote-tier",
                        "redis://nowhere:0x1/0", "--store-dir", str(tmp_path / "s")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--remote-tier" in r.stderr
    assert not (tmp_path / "s").exists()


# -- one configuration ------------------------------------------------------------------------
FLAGS = ["--model", MODEL, "--policy", "as_like", "--plan", "recompute", "--disk-read-limit",
         "20", "--remote-tier", "redis://127.0.0.1:6379/2", "--chunk-size", "32",
         "--gpu-cache-gb", "0.5", "--store-dir", "/srv/stores", "--disk-capacity-gb", "2",
         "--reorder-interval", "7", "--verify-tier-hits", "--retention", "0.5"]


def test_the_config_holds_what_the_flags_said_once():
    config = ServiceConfig.from_args(run.parse_args(FLAGS))
    assert {f.name for f in dataclasses.fields(ServiceConfig)} == {
        "runtime", "run", "tiers", "store", "queue_size", "timeout_s", "max_batch_size",
        "max_batch_tokens", "batch_gather_s", "score_piece_tokens", "throughput"}
    assert (config.max_batch_size, config.max_batch_tokens) == (8, 8192)
    assert config.score_piece_tokens is None      # the scheduler's own default
    assert ServiceConfig.from_args(run.parse_args(
        FLAGS + ["--score-piece-tokens", "128"])).score_piece_tokens == 128
    assert config.batch_gather_s == 0.01
    assert ServiceConfig.from_args(run.parse_args(
        FLAGS + ["--batch-gather-ms", "0"])).batch_gather_s == 0
    sized = ServiceConfig.from_args(run.parse_args(["--max-batch-size", "3",
                                                    "--max-batch-tokens", "100"]))
    assert (sized.max_batch_size, sized.max_batch_tokens) == (3, 100)
    assert config.runtime.model == MODEL
    assert (config.run.policy, config.run.plan, config.run.chunk_size, config.run.retention) \
        == ("as_like", "recompute", 32, 0.5)
    assert config.run.serving().plan == "recompute"
    assert config.run.store_options()["chunk_size"] == 32
    t = config.tiers
    assert (t.gpu_bytes, t.cpu_bytes, t.verify_hits, t.remote_url) == \
        (GB // 2, 1 << 30, True, "redis://127.0.0.1:6379/2")
    assert config.store == StoreOptions(root="/srv/stores", disk_capacity_bytes=2 * GB,
                                        reorder_interval=7, read_limit_mb_s=20.0)
    assert config.store.open_options() == {"disk_capacity_bytes": 2 * GB,
                                            "reorder_interval": 7, "read_limit_mb_s": 20.0}
    # The runtime leaves room for the tiers: derived from them, not a second copy.
    rc = config.runtime_config()
    assert (rc.gpu_reserve_bytes, rc.cpu_reserve_bytes) == (t.gpu_bytes, t.cpu_bytes)
    assert config.runtime.gpu_reserve_bytes == 0
    assert "plan recompute" in config.plan_line() and "redis://127.0.0.1:6379/2" in \
        config.plan_line() and "20 MB/s" in config.plan_line()


def test_tiers_are_non_exclusive_unless_the_flag_says_exclusive():
    assert ServiceConfig().tiers.exclusive is False
    assert ServiceConfig.from_args(run.parse_args([])).tiers.exclusive is False
    for parse in (run.parse_args, serve.parse_args):
        tiers = ServiceConfig.from_args(parse(["--exclusive-tiers"])).tiers
        assert tiers.exclusive is True and tiers.copies == "exclusive"


def test_run_and_serve_build_the_same_config_from_the_same_flags():
    assert ServiceConfig.from_args(run.parse_args(FLAGS)) == \
        ServiceConfig.from_args(serve.parse_args(FLAGS))
    sized = ServiceConfig.from_args(run.parse_args(["--cpu-cache-gb", "1.5"]), policy="full",
                                    default_tiers=(100, 200))
    assert (sized.run.label, sized.tiers.gpu_bytes, sized.tiers.cpu_bytes) == \
        ("full", 100, int(1.5 * GB))


def test_one_tier_record_and_every_part_typed():
    import typing

    hints = typing.get_type_hints(ServiceConfig)
    assert (hints["runtime"], hints["run"], hints["tiers"], hints["store"]) == \
        (RuntimeConfig, RunConfig, TierConfig, StoreOptions)
    sized = TierConfig(1, 2, remote_url="redis://127.0.0.1:6379/0", remote_secret="hush-7")
    assert "hush-7" not in repr(sized) and ServiceConfig(tiers=sized).tiers.remote_url


def test_one_chunk_size_default():
    job = Job([1, 2, 3], 1, None)
    assert RunConfig("x", "x").chunk_size == job.chunk_size == CHUNK_SIZE == 16
    assert inspect.signature(Frontend).parameters["chunk_size"].default == CHUNK_SIZE
    assert ServiceConfig().run.chunk_size == CHUNK_SIZE
    # The library's plan stays "load"; only the product plans by default.
    assert RunConfig("x", "x").plan == ServiceConfig().run.plan == "load"


def test_the_flat_keywords_fold_into_their_parts():
    config = ServiceConfig(model=MODEL, store_root="/tmp/x", gpu_cache_bytes=5,
                           cpu_cache_bytes=7, queue_size=3)
    assert config.runtime.model == MODEL and config.store.root == "/tmp/x"
    assert (config.tiers.gpu_bytes, config.tiers.cpu_bytes) == (5, 7)
    again = dataclasses.replace(config, timeout_s=9.0)
    assert again.tiers == config.tiers and again.runtime == config.runtime


def test_a_password_in_the_pool_url_is_never_printed():
    assert redact_url("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert redact_url("redis://me:s3cret@host/1") == "redis://me:***@host/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    # TLS and other secrets in the query, also under an encoded name redis-py decodes.
    assert redact_url("rediss://h:6380/0?ssl_password=s3cret&ssl_cert_reqs=none") == \
        "rediss://h:6380/0?ssl_password=***&ssl_cert_reqs=none"
    assert redact_url("rediss://h:6380?ssl%5Fpassword=s3cret") == \
        "rediss://h:6380?ssl%5Fpassword=***"
    assert "s3cret" not in redact_url("redis://h/0?db=1&auth_token=s3cret")
    config = ServiceConfig(model=MODEL, tiers=TierConfig(
        remote_url="rediss://u:s3cret@h:6380/0?ssl_password=s3cret"))
    assert "s3cret" not in config.plan_line() and "rediss://u:***@h:6380/0" in \
        config.plan_line()


def test_a_url_that_cannot_be_read_is_refused_without_its_password(capsys):
    from impress_flexgen.entrypoints.openai import server as serve

    with pytest.raises(SystemExit) as exit_:
        serve.parse_args(["--remote-tier", "redis://:s3cret@[::1/0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "s3cret" not in err and "cannot be read" in err


# -- reaching the engine ----------------------------------------------------------------------
@pytest.mark.slow
def test_run_plan_recompute_reaches_the_engine(tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    prefix = _ids(1, 80)
    requests.write_text("".join(json.dumps({"prompt_ids": prefix + _ids(s, 5),
                                            "max_tokens": 2}) + "\n" for s in (2, 3)))
    out = tmp_path / "out.json"
    assert run.main(["--model", MODEL, "--requests", str(requests), "--plan", "recompute",
                     "--store-dir", str(tmp_path / "stores"), "--json", str(out),
                     "--offload-dir", str(tmp_path / "off")]) == 0
    printed = capsys.readouterr().out
    assert "plan recompute; no shared pool" in printed
    assert "plans load 0, recompute 1, both 0" in printed
    result = json.loads(out.read_text())
    assert result["plans"] == {"load": 0, "recompute": 1, "both": 0}
    assert result["shared_bytes"] == 0
    first, second = (r["stats"] for r in result["results"])
    assert first["plan"] is None                  # nothing stored yet: nothing to plan
    assert second["matched_tokens"] == 80 and second["plan"] == "recompute"
    assert second["plan_split"] == 80 // CHUNK_SIZE
    assert sum(second["bytes_read"].values()) == 0 and second["computed_tokens"] == 80 + 5


@pytest.mark.slow
def test_the_workload_summary_counts_plans(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert run.main(["--model", MODEL, "--prefixes", "1", "--prefix-tokens", "96",
                     "--queries", "2", "--query-tokens", "8", "--max-new-tokens", "1",
                     "--plan", "recompute", "--disk-read-limit", "500", "--json", str(out),
                     "--store-dir", str(tmp_path / "stores"),
                     "--offload-dir", str(tmp_path / "off")]) == 0
    printed = capsys.readouterr().out
    assert "disk reads held to 500 MB/s" in printed and "load/recompute/both" in printed
    row = json.loads(out.read_text())["results"][0]
    assert row["plans"] == {"load": 0, "recompute": 2, "both": 0}
    assert list(row["bytes_read"]) == list(TierConfig().names(remote=False))
    assert row["shared_bytes"] == 0 and row["config"]["plan"] == "recompute"
    assert json.loads(out.read_text())["workload"]["disk_read_limit_mb_s"] == 500


@pytest.mark.parametrize("url", ["redis://10.0.0.7:6379/0", "rediss://pool.example:6380/0",
                                 "redis+cluster://127.0.0.1:7000,10.0.0.8:7001"])
def test_a_pool_on_another_machine_without_a_secret_is_refused_in_one_line(url, tmp_path,
                                                                           capsys, monkeypatch):
    """Anyone able to write to such a pool could change answers: a secret, or an explicit
    --remote-insecure. Refused before anything is built."""
    monkeypatch.delenv("IMPRESS_REMOTE_SECRET", raising=False)
    argv = ["--model", MODEL, "--remote-tier", url, "--store-dir", str(tmp_path / "s"),
            "--prompt", "hello"]
    rc = run_main("python -m impress_flexgen.run", run.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--remote-insecure" in err[0], err
    assert "--remote-secret" in err[0] and not (tmp_path / "s").exists()
    for extra in (["--remote-secret", "shared"], ["--remote-insecure"]):
        assert ServiceConfig.from_args(run.parse_args(argv + extra)).tiers.remote_url == url
    monkeypatch.setenv("IMPRESS_REMOTE_SECRET", "from-the-environment")
    assert ServiceConfig.from_args(run.parse_args(argv)).tiers.remote_url == url


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://localhost:6379/1",
                                 "redis://[::1]:6379/0", "unix:///run/redis.sock",
                                 "redis+cluster://127.0.0.1:7000,127.0.0.2:7001"])
def test_a_pool_on_this_machine_needs_no_secret(url, monkeypatch):
    monkeypatch.delenv("IMPRESS_REMOTE_SECRET", raising=False)
    args = run.parse_args(["--model", MODEL, "--remote-tier", url])
    assert ServiceConfig.from_args(args).tiers.remote_url == url


@pytest.mark.slow
def test_a_plan_that_needs_the_cost_model_is_calibrated_at_start(runtime, tmp_path):
    args = serve.parse_args(["--model", MODEL, "--plan", "both", "--disk-read-limit", "40",
                             "--store-dir", str(tmp_path / "stores")])
    costs = tmp_path / "cache" / "costs"
    with Service(ServiceConfig.from_args(args), runtime=runtime) as service:
        assert service.engine.config.plan == "both" and service.engine.planner is not None
        assert list(costs.glob("*.json")), "not calibrated before the first request"
        assert service.store.config.read_limit_mb_s == 40
        assert any("plan both" in line for line in service.describe())
        assert service.warnings == []


# -- /metrics and the shared pool --------------------------------------------------------------
@pytest.fixture(scope="module")
def pool():
    with RedisServer(require_redis_server()) as srv:
        yield srv


def _service(runtime, root, url, plan="load", secret="pool-secret"):
    args = serve.parse_args(["--model", MODEL, "--plan", plan, "--remote-tier", url,
                             "--store-dir", str(root)]
                            + (["--remote-secret", secret] if secret else []))
    return Service(ServiceConfig.from_args(args), runtime=runtime)


@pytest.mark.slow
def test_a_pool_without_a_secret_is_a_warning_at_start(runtime, tmp_path, pool, monkeypatch):
    monkeypatch.delenv("IMPRESS_REMOTE_SECRET", raising=False)
    with _service(runtime, tmp_path / "s", pool.url, secret=None) as service:
        assert len(service.warnings) == 1, service.warnings
        assert "has no secret" in service.warnings[0]
        assert "never stored locally" in service.warnings[0]


def test_metrics_show_every_tier_plans_and_the_pool(runtime, tmp_path, pool):
    redis.Redis.from_url(pool.url).flushdb()
    clean, spoiled = _ids(10, 96), _ids(11, 96)
    with _service(runtime, tmp_path / "a", pool.url) as writer:
        for prefix in (clean, spoiled):
            writer.complete(writer.frontend.build(prompt_ids=prefix + [7], max_tokens=1))
        assert writer.engine.shared.tier.flush(10)
        namespace = writer.engine.shared.namespace
    # Damage every stored value of one prefix: the pool still says it holds it.
    client = redis.Redis.from_url(pool.url)
    for h in chunk_hashes(namespace, spoiled):
        for layer in range(namespace.n_layers):
            client.set(layer_key(h, layer), b"damaged")
    # A second server on an empty store of its own: what it reads comes from the pool.
    with _service(runtime, tmp_path / "b", pool.url) as reader, \
            background_server(reader) as url:
        assert reader.warnings == [] and reader.describe_serving()[1].endswith(pool.url)
        got = reader.complete(reader.frontend.build(prompt_ids=clean + _ids(12, 5),
                                                    max_tokens=1))
        assert got.stats["shared_tokens"] == 96 and got.stats["bytes_read"][REMOTE] > 0
        again = reader.complete(reader.frontend.build(prompt_ids=clean + _ids(13, 5),
                                                      max_tokens=1))
        assert again.stats["matched_tokens"] == 96 and again.stats["plan"] == "load"
        bad = reader.complete(reader.frontend.build(prompt_ids=spoiled + _ids(14, 5),
                                                    max_tokens=1))
        assert bad.stats["shared_tokens"] == 0 and reader.engine.shared_fallbacks == 1
        m = _metrics(url)
    for tier in TierConfig().names(remote=True):
        assert _metric(m, "kv_bytes_read_total", tier=tier) is not None, tier
    assert _metric(m, "kv_bytes_read_total", tier=REMOTE) == got.stats["bytes_read"][REMOTE]
    assert _metric(m, "prompt_tokens_total", source="shared") == 96
    assert {p: _metric(m, "plans_total", plan=p) for p in ("load", "recompute", "both")} == \
        {"load": 1, "recompute": 0, "both": 0}
    assert _metric(m, "shared_pool_down") == 0
    assert _metric(m, "shared_pool_fallbacks_total") == 1
    assert 0 < _metric(m, "tier_hit_ratio", tier=REMOTE) <= 1


def test_an_unreachable_pool_is_a_warning_and_requests_are_served_locally(runtime, tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"      # nobody listens there
    with _service(runtime, tmp_path / "s", url) as service, \
            background_server(service) as base:
        assert len(service.warnings) == 1 and "does not answer" in service.warnings[0]
        assert "not answering" in service.describe_serving()[1]
        prompt = _ids(20, 64) + [5]
        for _ in range(2):
            done = service.complete(service.frontend.build(prompt_ids=prompt, max_tokens=2))
        assert done.completion_tokens == 2 and done.stats["matched_tokens"] == 64
        m = _metrics(base)
    assert _metric(m, "shared_pool_down") == 1
    assert _metric(m, "requests_total", outcome="ok") == 2


def test_without_a_pool_there_are_no_pool_series(runtime, tmp_path):
    args = serve.parse_args(["--model", MODEL, "--plan", "load", "--store-dir",
                             str(tmp_path / "s")])
    with Service(ServiceConfig.from_args(args), runtime=runtime) as service, \
            background_server(service) as url:
        m = _metrics(url)
    assert _metric(m, "shared_pool_down") is None
    assert _metric(m, "kv_bytes_read_total", tier=REMOTE) is None
    assert _metric(m, "plans_total", plan="load") == 0


# -- make test: redis-server -- ------------------------------------------------------------------
MISSING = ["REDIS_SERVER=no-such-redis-server", "REDIS_PATHS=/nonexistent/redis-server"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_setup_says_how_to_install_redis_when_it_cannot(tmp_path):
    r = subprocess.run(["make", "--no-print-directory", "redis-server", *MISSING,
                        "APT_GET=no-such-apt-get"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "redis-server is missing" in r.stderr and "apt-get install -y redis-server" in \
        r.stderr


@pytest.mark.skipif(shutil.which("make") is None or os.geteuid() != 0,
                    reason="needs make, and root (the install step would ask sudo)")
def test_setup_installs_the_package_without_starting_its_service(tmp_path):
    fake = tmp_path / "apt-get"
    log, policy = tmp_path / "log", tmp_path / "policy-rc.d"
    fake.write_text('#!/bin/sh\necho "$DEBIAN_FRONTEND $* refuses=$(sh "$POLICY"; echo $?)" '
                    '>> "$LOG"\n')
    fake.chmod(0o755)
    r = subprocess.run(["make", "--no-print-directory", "redis-server", *MISSING,
                        f"APT_GET={fake}", f"POLICY_RC={policy}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LOG": str(log), "POLICY": str(policy)})
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "noninteractive install -y --no-install-recommends redis-server refuses=101"]
    assert not policy.exists()                   # removed once installed
    assert "redis-server is missing" in r.stderr    # the fake installed nothing
