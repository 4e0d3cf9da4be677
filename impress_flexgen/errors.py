"""Errors that reach a user as one line and exit status 2, never as a traceback; and the
store's own, which the engine serves around (a corrupt node is recomputed, a prefix that
could not be stored is only not stored)."""


class UserError(Exception):
    """Bad input from the user: wrong argument, missing file, unsupported combination."""


class ServiceError(Exception):
    """A request that cannot be served as asked: an HTTP status and one line for the user."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s    # a 429's Retry-After, in whole seconds
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def require(module: str, purpose: str, pip_spec: str) -> None:
    """An optional package that `purpose` needs, asked for before anything loads: a missing
    one is a one-line UserError naming what to install (the core never imports these)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):   # an import system that refuses the name
        found = False
    if not found:
        raise UserError(f"{purpose} needs the '{module}' package, which is not installed: "
                        f"pip install {pip_spec}")


class CorruptNode(Exception):
    """A chunk or probe section failed its CRC, or reading its file failed in any way
    (short, missing, not a regular file, a symbolic link, an I/O error)."""

    def __init__(self, node, detail: str):
        super().__init__(f"node {node.id}: {detail}")
        self.node = node


class StoreWriteFailed(Exception):
    """New KV could not be committed (the request is still served; its prefix is not
    stored)."""


class StoreFull(StoreWriteFailed):
    """No room for new KV even after evicting every unlocked leaf, or the disk or the
    metadata database is full."""


class DiskFull(StoreFull):
    """Writing a layer file failed with ENOSPC: the disk itself is full."""
