"""A shared pool's url: checked, redacted for logs, split into a cluster's seed nodes.

    redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., unix://PATH
    redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]    (a Redis or Valkey cluster)

Kept free of the Redis client so that the command line checks a url without importing it.
"""
from __future__ import annotations

import re
import urllib.parse

from ..errors import UserError

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
# A query parameter whose (decoded) name says it holds a secret: password, ssl_password,
# pwd, secret, token, auth, credential_..., a key. Its value is printed as ***.
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|auth|cred|key", re.IGNORECASE)
_PARAM = re.compile(r"([?&;])([^=&#;?]*)=([^&#;]*)")


def is_cluster(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme.endswith("+cluster")


def _redact_query(text: str) -> str:
    def hide(m: re.Match) -> str:
        # Named as the client will read it: ssl%5Fpassword is ssl_password to redis-py.
        name = urllib.parse.unquote_plus(m.group(2))
        return f"{m.group(1)}{m.group(2)}=***" if _SECRET_NAME.search(name) else m.group(0)

    return _PARAM.sub(hide, text)


def redact_url(url: str) -> str:
    """The url fit to print: the password in its userinfo (a bare userinfo may be a token:
    all of it) and the value of any query parameter named for a secret (password,
    ssl_password, token, ...) become ***."""
    if not isinstance(url, str):
        return repr(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _redact_query(url)
    netloc, slash, tail = rest.partition("/")
    if "?" in netloc:  # redis://host:port?password=x (no path)
        netloc, q, query = netloc.partition("?")
        tail, slash = "?" + query + slash + tail, ""
    if "@" in netloc:
        info, _, host = netloc.rpartition("@")
        user, colon, _ = info.partition(":")
        netloc = (f"{user}:***@" if colon else "***@") + host
    return _redact_query(f"{scheme}://{netloc}{slash}{tail}")


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, bool]:
    """The seed nodes of a cluster url, its username, password and whether it uses TLS."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    user = password = None
    if "@" in netloc:
        info, _, netloc = netloc.rpartition("@")
        name, colon, pw = info.partition(":")
        user = urllib.parse.unquote(name) or None
        password = urllib.parse.unquote(pw) if colon else None
    nodes = []
    for item in netloc.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UserError(f"remote tier: cluster node {item.strip()!r} in "
                            f"{redact_url(url)!r} must be HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    return nodes, user, password, parts.scheme.startswith("rediss")


def validate_url(url: str) -> None:
    if not isinstance(url, str) or not url:
        raise UserError("remote tier: url must be like redis://HOST:PORT/DB")
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:     # e.g. an unclosed [IPv6 address: its text holds the url
        raise UserError(f"remote tier: url {shown!r} cannot be read ({type(exc).__name__})"
                        ) from None
    if parts.scheme not in SCHEMES:
        raise UserError(f"remote tier: url {shown!r} must start with one of "
                        f"{', '.join(s + '://' for s in SCHEMES)} (e.g. redis://127.0.0.1:6379/0)")
    if parts.scheme == "unix":
        if not parts.path:
            raise UserError(f"remote tier: url {shown!r} names no socket path")
        return
    if is_cluster(url):
        if not parts.netloc.rpartition("@")[2]:
            raise UserError(f"remote tier: url {shown!r} names no node "
                            "(e.g. redis+cluster://127.0.0.1:7000,127.0.0.1:7001)")
        cluster_nodes(url)
        if parts.path.strip("/") not in ("", "0"):
            raise UserError(f"remote tier: url {shown!r}: a cluster has only database 0")
        return
    if not parts.hostname:
        raise UserError(f"remote tier: url {shown!r} names no host (e.g. redis://127.0.0.1:6379/0)")
    try:
        _ = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError:
        raise UserError(f"remote tier: url {shown!r} has a bad port; expected 1..65535") from None
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise UserError(f"remote tier: url {shown!r} has a bad database {db!r}; expected a number")


# -- trust ---------------------------------------------------------------------------------
SECRET_ENV = "IMPRESS_REMOTE_SECRET"     # the pool's shared secret, where no flag gives one
_LOOPBACK_NAMES = ("localhost", "localhost.", "ip6-localhost")


def _loopback_host(host: str) -> bool:
    import ipaddress

    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False      # a name is not looked up: it may point anywhere


def is_loopback(url: str) -> bool:
    """Whether the pool at `url` is on this machine (a unix socket, or every host a
    loopback address or localhost): only this machine's users can write to it then."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return True
    if is_cluster(url):
        return all(_loopback_host(host) for host, _ in cluster_nodes(url)[0])
    return bool(parts.hostname) and _loopback_host(parts.hostname)


def check_pool_trust(url: str | None, secret: str | None, insecure: bool) -> None:
    """Refuse a pool another machine can write to when its values carry no HMAC (no shared
    secret), unless the operator said so: whoever can write to it could change answers."""
    if url is None or secret or insecure or is_loopback(url):
        return
    raise UserError(f"--remote-tier {redact_url(url)} is not on this machine and has no "
                    f"--remote-secret (or {SECRET_ENV}): anyone able to write to it could "
                    "change answers; give a secret shared by the pool's servers, or "
                    "--remote-insecure to use it unauthenticated")
