"""Errors that reach a user as one line and exit status 2, never as a traceback."""


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
