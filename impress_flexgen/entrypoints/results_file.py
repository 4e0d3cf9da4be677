"""A request file's --output: replaced only once complete, never cut.

Results go to a temporary file in the output's directory, are fsynced and renamed over the
output at the end, so a run that fails (bad input, a full disk, an interrupted run) leaves
what was there before untouched, and a reader never sees half a file. With resume, the
complete lines already in the output are copied first and their ids skipped; a run with
resume that is interrupted or fails while serving keeps what it finished, the same way, so
that the next one continues from there. A line that cannot be trusted to answer its request
(not a complete result, an id that is not in the request file, an id on two lines) is not
copied: its request is served again and the rewritten output goes without it.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

from ..errors import UserError

_write = os.write      # every write and fsync goes through these (tests make them fail)
_fsync = os.fsync
_open = open


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through symbolic or hard links); False when either
    does not exist."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise UserError(f"cannot use {exc.filename}: {exc.strerror or exc}") from None
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def result_id(record) -> str | None:
    """The request id of an output line of either format (None: not a result line)."""
    if not isinstance(record, dict):
        return None
    rid = record.get("custom_id", record.get("id"))
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


# What every complete line holds: a plain result (Done.record()) or an OpenAI batch record.
PLAIN_RESULT = {"id", "text", "token_ids", "finish_reason", "prompt_tokens",
                "completion_tokens"}
BATCH_RESULT = {"id", "custom_id", "response", "error"}


def complete_id(record) -> str | None:
    """The request id of a complete result line of either format, None for anything else
    (a line damaged into other JSON, a record missing its answer)."""
    rid = result_id(record)
    if rid is None:
        return None
    if "custom_id" in record:
        response = record.get("response")
        ok = BATCH_RESULT <= record.keys() and isinstance(response, dict) \
            and isinstance(response.get("status_code"), int)
    else:
        ok = PLAIN_RESULT <= record.keys() and isinstance(record["token_ids"], list) \
            and isinstance(record["text"], str)
    return rid if ok else None


def _parsed_id(raw: bytes) -> str | None:
    try:
        return complete_id(json.loads(raw))
    except (ValueError, RecursionError):
        return None


class ResultsFile:
    """The output of a request file, written atomically. Made before the model is built (a
    path that cannot be written fails early; `ids`: the requests already in the output, with
    resume); start() opens the temporary file, write() adds a line, commit() puts the file
    in place, discard() drops it."""

    def __init__(self, path: str, requests: str, resume: bool = False):
        self.shown = path
        if same_file(path, requests):
            raise UserError(f"--output {path} is the request file {requests}: choose another "
                            "path (the results would replace the requests)")
        # A symbolic link is written through: the file it names is replaced, not the link.
        self.path = os.path.realpath(path)
        self.resume = resume
        self.ids: set[str] = set()
        self.kept = self.dropped = self.written = 0
        self.damaged: list[str] = []   # why each line of the output is not kept
        self.size = 0            # bytes of complete lines in the temporary file
        self.fd: int | None = None
        self.tmp: str | None = None
        self.mode: int | None = None
        target = Path(self.path)
        try:
            if target.is_dir():
                raise UserError(f"--output {path} is a directory")
            if target.exists():
                self.mode = stat.S_IMODE(target.stat().st_mode)
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        self._create()       # can the directory take it? (nothing is left behind)
        self.discard()
        if resume and self.mode is not None:
            self._scan()

    def _create(self) -> None:
        target = Path(self.path)
        self.tmp = str(target.with_name(f".{target.name}.{os.getpid()}."
                                        f"{secrets.token_hex(4)}.part"))
        try:
            # Created as open(path, "w") would create the output: the umask applies.
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            self.tmp = None
            raise UserError(f"cannot write {self.shown}: {exc.strerror or exc}") from None

    def start(self) -> None:
        """Open the temporary file; with resume, copy the earlier results into it."""
        self._create()
        try:
            if self.resume and self.mode is not None:
                self._copy_kept()
        except BaseException:
            self.discard()
            raise

    def _scan(self) -> None:
        """Note the ids of the output's complete result lines. A last line without its
        newline (a run cut short by an older version), a line that is not a complete result
        and every line of an id found twice are not kept: their requests are served again.
        An output with no result line at all is refused (not an output of a request file)."""
        lines: dict[str, int] = {}
        twice: set[str] = set()
        self.damaged, self.dropped, first_bad = [], 0, None
        try:
            with _open(self.path, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if not raw.endswith(b"\n"):
                        self.dropped += 1
                        self.damaged.append(f"line {n} is cut short")
                        break
                    if not raw.strip():
                        continue
                    rid = _parsed_id(raw)
                    if rid is None:
                        first_bad = first_bad or n
                        self.damaged.append(f"line {n} is not a complete result")
                    elif rid in lines:
                        twice.add(rid)
                        self.damaged.append(f"line {n} repeats the id {rid!r} of line "
                                            f"{lines[rid]}")
                    else:
                        lines[rid] = n
        except OSError as exc:
            raise UserError(f"cannot read {self.shown}: {exc.strerror or exc}") from None
        if first_bad is not None and not lines:
            raise UserError(f"cannot resume: {self.shown} line {first_bad} is not a result "
                            "line (a JSON object with an id)")
        self.ids = set(lines) - twice
        self.kept = len(self.ids)

    def match(self, found: set[str]) -> None:
        """Keep only the results of requests in the request file (`found`: the ids of
        ours it has); a line with any other id was damaged or belongs to another file."""
        stray = sorted(self.ids - found)
        self.damaged += [f"the id {rid!r} is not in the request file" for rid in stray]
        self.ids -= set(stray)
        self.kept = len(self.ids)

    def describe_damage(self) -> str | None:
        """One line on what the output held that is not kept, or None."""
        if not self.damaged:
            return None
        shown = "; ".join(self.damaged[:3]) + ("; ..." if len(self.damaged) > 3 else "")
        return (f"{self.shown}: {len(self.damaged)} earlier line(s) not kept ({shown}); their "
                "requests are served again and the output is rewritten without them")

    def _copy_kept(self) -> None:
        """Copy the output's complete lines whose ids are kept, each once."""
        copied: set[str] = set()
        try:
            with _open(self.path, "rb") as f:
                for raw in f:
                    if not raw.endswith(b"\n"):
                        break
                    rid = _parsed_id(raw) if raw.strip() else None
                    if rid in self.ids and rid not in copied:
                        copied.add(rid)
                        self._put(raw)
        except OSError as exc:
            raise UserError(f"cannot read {self.shown}: {exc.strerror or exc}") from None
        # The requests to serve were fixed by the scan: a kept line gone since would be lost.
        if copied != self.ids:
            raise UserError(f"{self.shown} changed while this run started; run it again")

    def _put(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[_write(self.fd, view):]
        except OSError as exc:
            self.discard()
            raise UserError(f"cannot write {self.shown}: {exc.strerror or exc}") from None
        self.size += len(data)

    def write(self, record: dict) -> None:
        """One result line (UserError, the output left untouched, if it cannot be written)."""
        self._put((json.dumps(record) + "\n").encode("utf-8"))
        self.written += 1

    def commit(self) -> None:
        """fsync the results and rename them over the output (then fsync the directory, so
        that the rename itself survives a crash)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, self.size)   # a line cut by an interrupted write goes
            _fsync(self.fd)
            if self.mode is not None:
                os.fchmod(self.fd, self.mode)
            os.close(self.fd)
            self.fd = None
            os.replace(self.tmp, self.path)
            self.tmp = None
        except OSError as exc:
            self.discard()
            raise UserError(f"cannot write {self.shown}: {exc.strerror or exc}") from None
        try:
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                _fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass   # some filesystems cannot fsync a directory; the data itself is synced

    def discard(self) -> None:
        """Drop the temporary file; the output stays as it was."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = None

    def finish(self, ok: bool) -> bool:
        """At the end of a run: commit when it succeeded, and with resume also when it
        stopped early with results to keep; otherwise discard. Whether it was committed."""
        if self.fd is not None and (ok or (self.resume and self.written)):
            self.commit()
            return True
        self.discard()
        return False
