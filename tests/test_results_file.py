"""A request file's --output is replaced only once a run is complete: never truncated first,
never the input itself, never cut by a full disk; --resume continues an earlier output."""
from __future__ import annotations

import errno
import json
import os

import pytest

from impress_flexgen.entrypoints import request_files, results_file
from impress_flexgen.entrypoints import run
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError

MODEL = "llama-tiny"
PROG = "python -m impress_flexgen.run"


def _requests(path, n, start=0):
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": [17 + i, 18, 19, 20],
                                        "max_tokens": 2, "temperature": 0}) + "\n"
                            for i in range(start, start + n)))


def _append(path, n, start):
    with open(path, "a") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"r{i}", "prompt_ids": [17 + i, 18, 19, 20],
                                "max_tokens": 2, "temperature": 0}) + "\n")


def _run(tmp_path, capsys, requests, out, *extra):
    rc = run_main(PROG, run.main, ["--model", MODEL, "--requests", str(requests),
                                   "--output", str(out), "--store-dir", str(tmp_path / "st"),
                                   "--offload-dir", str(tmp_path / "off"), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err.strip().splitlines()


def _ids(out):
    return [json.loads(line)["id"] for line in out.read_text().splitlines()]


def _leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".part")]


def _fail_serving_after(monkeypatch, n):
    """The engine fails every request after the first n (as a bad request would)."""
    from impress_flexgen.engine.prefix import Prefixes

    # Every request's prefix is opened (matched and planned), alone or in a shared pass.
    opened, seen = Prefixes.open, []

    def failing(self, seq, *args, **kwargs):
        request = seq.request
        prompt = [*request.prefix, *request.query]
        if prompt not in seen:
            seen.append(prompt)
        if seen.index(prompt) >= n:
            raise UserError("the engine refused this request")
        return opened(self, seq, *args, **kwargs)

    monkeypatch.setattr(Prefixes, "open", failing)


def test_a_failed_rerun_leaves_the_earlier_output_untouched(tmp_path, capsys, monkeypatch):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 3)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    assert rc == 0 and _ids(out) == ["r0", "r1", "r2"]
    good = out.read_bytes()
    _fail_serving_after(monkeypatch, 1)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    assert rc == 2 and len(err) == 1 and "request r1" in err[0] and "line 2" in err[0], err
    assert out.read_bytes() == good                 # not truncated, not half rewritten
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "relative"])
def test_the_output_is_never_the_request_file(tmp_path, capsys, monkeypatch, how):
    requests = tmp_path / "in.jsonl"
    _requests(requests, 2)
    before = requests.read_bytes()
    out = {"same": requests, "symlink": tmp_path / "link.jsonl",
           "hardlink": tmp_path / "hard.jsonl", "relative": "sub/../in.jsonl"}[how]
    if how == "symlink":
        out.symlink_to(requests)
    elif how == "hardlink":
        os.link(requests, out)
    elif how == "relative":
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    assert rc == 2 and len(err) == 1 and "is the request file" in err[0], err
    assert requests.read_bytes() == before and not (tmp_path / "st").exists()


def test_a_symlinked_output_is_written_through(tmp_path, capsys):
    requests, real = tmp_path / "in.jsonl", tmp_path / "real.jsonl"
    _requests(requests, 1)
    real.write_text("old\n")
    os.chmod(real, 0o640)
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    rc, _, _ = _run(tmp_path, capsys, requests, link)
    assert rc == 0 and link.is_symlink() and _ids(real) == ["r0"]
    assert (real.stat().st_mode & 0o777) == 0o640   # the replaced file keeps its mode


@pytest.mark.parametrize("fail", ["write", "fsync"])
def test_a_full_disk_is_one_line_and_the_earlier_output_stays(tmp_path, capsys, monkeypatch,
                                                              fail):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 3)
    out.write_text('{"id": "earlier"}\n')
    write, calls = results_file._write, []

    def full(fd, data):
        calls.append(1)
        if len(calls) > 1:      # the first line goes through, the second finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data[: max(1, len(data) // 2)])   # short writes are completed

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    if fail == "write":
        monkeypatch.setattr(results_file, "_write", full)
    else:
        monkeypatch.setattr(results_file, "_fsync", broken)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    why = "No space left on device" if fail == "write" else "Input/output error"
    assert rc == 2 and len(err) == 1 and f"cannot write {out}: {why}" in err[0], err
    assert out.read_text() == '{"id": "earlier"}\n'
    assert not _leftovers(tmp_path)


@pytest.mark.slow
def test_a_read_error_is_one_line(tmp_path, capsys, monkeypatch):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 3)

    class Failing:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def __iter__(self):
            yield next(iter(self.f))
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(request_files, "_open", Failing)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    assert rc == 2 and len(err) == 1 and "Input/output error" in err[0], err
    assert f"cannot read {requests}" in err[0] and not out.exists()
    rc, _, err = _run(tmp_path, capsys, tmp_path, out)     # a directory
    assert rc == 2 and len(err) == 1 and "cannot read" in err[0]
    rc, _, err = _run(tmp_path, capsys, requests, tmp_path)
    assert rc == 2 and len(err) == 1 and "is a directory" in err[0]
    monkeypatch.undo()
    fifo = tmp_path / "fifo"      # a pipe would be empty when read the second time
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)   # so that opening it does not block
    try:
        rc, _, err = _run(tmp_path, capsys, fifo, out)
    finally:
        os.close(writer)
    assert rc == 2 and len(err) == 1 and "is not a regular file" in err[0], err


@pytest.mark.slow
def test_resume_serves_only_the_requests_not_in_the_output(tmp_path, capsys):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 2)
    assert _run(tmp_path, capsys, requests, out)[0] == 0
    first = out.read_bytes()
    _append(requests, 2, start=2)
    rc, printed, _ = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and _ids(out) == ["r0", "r1", "r2", "r3"]
    assert out.read_bytes().startswith(first)     # the earlier lines as they were
    assert "2 requests:" in printed and "2 earlier results kept" in printed
    # A cut last line (no newline: a run stopped mid-write) is served again.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:10])
    rc, printed, _ = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and _ids(out) == ["r0", "r1", "r2", "r3"] and "1 requests:" in printed
    # Nothing left: nothing is served, the output stays.
    before = out.read_bytes()
    rc, printed, _ = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and "nothing to serve" in printed and out.read_bytes() == before


@pytest.mark.slow
def test_resume_refuses_a_request_file_with_a_repeated_id(tmp_path, capsys):
    """A repeated id would make its second request look answered by the first's result."""
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 2)
    assert _run(tmp_path, capsys, requests, out)[0] == 0
    before = out.read_bytes()
    _append(requests, 1, start=1)                  # r1 again, a different request
    with open(requests, "a") as f:
        f.write(json.dumps({"id": "r1", "prompt_ids": [30, 31], "max_tokens": 1}) + "\n")
    rc, _, err = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 2 and len(err) == 1 and "line 3: id 'r1' is also the id of line 2" in err[0]
    assert out.read_bytes() == before


def _lines(out):
    return out.read_text().splitlines(keepends=True)


@pytest.mark.slow
@pytest.mark.parametrize("damage, served", [
    # an id damaged into one that is not in the request file: r1 is served again
    (lambda ls: [ls[0], ls[1].replace('"id": "r1"', '"id": "r7"', 1), ls[2]], ["r1"]),
    # an id damaged into another request's: neither line can be trusted
    (lambda ls: [ls[0], ls[1].replace('"id": "r1"', '"id": "r0"', 1), ls[2]], ["r0", "r1"]),
    # a line cut inside but ending in a newline, and a record without its answer
    (lambda ls: [ls[0][:25] + "\n", '{"id": "r1"}\n', ls[2]], ["r0", "r1"]),
])
def test_resume_drops_damaged_output_lines_and_serves_them_again(tmp_path, capsys, damage,
                                                                 served):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 3)
    assert _run(tmp_path, capsys, requests, out)[0] == 0
    good = {json.loads(x)["id"]: x for x in _lines(out)}
    out.write_text("".join(damage(_lines(out))))
    rc, printed, err = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and f"{len(served)} requests:" in printed
    assert any("not kept" in line and "served again" in line for line in err), err
    kept = [r for r in ("r0", "r1", "r2") if r not in served]
    assert _ids(out) == kept + served
    assert all(good[r] == x for r, x in zip(kept, _lines(out)))   # copied as they were


@pytest.mark.slow
def test_resume_drops_a_stray_line_with_nothing_to_serve(tmp_path, capsys):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 2)
    assert _run(tmp_path, capsys, requests, out)[0] == 0
    clean = out.read_text()
    stray = json.loads(_lines(out)[0])
    stray["id"] = "elsewhere"
    out.write_text(clean + json.dumps(stray) + "\n")
    rc, printed, err = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and "nothing to serve" in printed
    assert len(err) == 1 and "'elsewhere' is not in the request file" in err[0], err
    assert out.read_text() == clean


@pytest.mark.slow
def test_a_resumed_run_that_stops_keeps_what_it_finished(tmp_path, capsys, monkeypatch):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 4)
    _fail_serving_after(monkeypatch, 2)
    rc, printed, err = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 2 and len(err) == 1 and "request r2" in err[0]
    assert _ids(out) == ["r0", "r1"] and "--resume continues" in printed
    monkeypatch.undo()
    rc, printed, _ = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and _ids(out) == ["r0", "r1", "r2", "r3"] and "2 requests:" in printed
    assert not _leftovers(tmp_path)


def test_resume_refuses_an_output_that_is_not_results(tmp_path, capsys):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 1)
    out.write_text("some notes\n")
    rc, _, err = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 2 and len(err) == 1 and "line 1 is not a result line" in err[0]
    assert out.read_text() == "some notes\n"
    with pytest.raises(SystemExit):
        run.main(["--model", MODEL, "--requests", str(requests), "--resume"])
    assert "--resume goes with --output" in capsys.readouterr().err


@pytest.mark.slow
def test_batch_lines_resume_by_custom_id(tmp_path, capsys):
    def line(cid):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": [17, 18, 19], "max_tokens": 1}}) + "\n"

    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text(line("a") + line("b"))
    assert _run(tmp_path, capsys, requests, out)[0] == 0
    requests.write_text(line("a") + line("b") + line("c"))
    rc, printed, _ = _run(tmp_path, capsys, requests, out, "--resume")
    assert rc == 0 and "1 requests:" in printed
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]


def test_a_request_file_that_changes_while_served_fails(tmp_path, capsys, monkeypatch):
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _requests(requests, 3)
    check = request_files.RequestFile.check

    def check_then_cut(self, skip=frozenset()):
        todo = check(self, skip)
        _requests(requests, 2)
        return todo

    monkeypatch.setattr(request_files.RequestFile, "check", check_then_cut)
    rc, _, err = _run(tmp_path, capsys, requests, out)
    assert rc == 2 and len(err) == 1 and "changed while it was served" in err[0], err
    assert not out.exists()
