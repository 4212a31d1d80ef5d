"""API keys: with keys configured, every request but the open paths needs `Authorization: Bearer KEY`.

Keys come from `--api-key` (repeatable), `--api-key-file` (one per line, `#` comments) or, when neither
is given, `$SLIMROUTE_API_KEY` (comma-separated). Only their SHA-256 digests are kept, and a presented
key is hashed and compared with every digest by `hmac.compare_digest` (equal lengths, no early exit),
so the time taken says nothing about which key, or how much of one, matched. A key never appears in an
answer, a log line or a metric.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

ENV_VAR = "SLIMROUTE_API_KEY"
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
REASONS = {  # why a request was refused -> the message it gets (no key is ever echoed)
    "missing": "this endpoint needs an API key: send the header 'Authorization: Bearer KEY'",
    "malformed": "the Authorization header must be 'Bearer KEY'",
    "invalid": "the API key is not valid",
}


def check_key(key: str, where: str) -> str:
    """A key is 1-4096 printable ASCII characters without spaces (what fits in a Bearer header)."""
    if not key:
        raise ValueError(f"{where}: the API key is empty")
    if len(key) > 4096:
        raise ValueError(f"{where}: the API key is longer than 4096 characters")
    if not all(33 <= ord(c) <= 126 for c in key):  # the message must not quote the key
        raise ValueError(f"{where}: an API key may only hold printable ASCII characters, without spaces")
    return key


def read_key_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {str(path)!r}: {type(exc).__name__}") from exc
    keys = [check_key(line.strip(), f"--api-key-file {path} line {n}")
            for n, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file: {str(path)!r} holds no key")
    return keys


def gather_keys(flag_keys: Iterable[str] | None = None, key_file: str | Path | None = None,
                environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The server's keys: the flags' and the file's, else those in $SLIMROUTE_API_KEY; () means no auth."""
    keys = [check_key(k.strip(), "--api-key") for k in flag_keys or ()]
    if key_file is not None:
        keys += read_key_file(key_file)
    if not keys:
        value = (os.environ if environ is None else environ).get(ENV_VAR, "")
        keys = [check_key(k.strip(), ENV_VAR) for k in value.split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable from outside
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """The accepted keys, as digests; `refusal(header)` -> None (accepted) or a key of REASONS."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(check_key(k, "api key")) for k in keys)
        if not self._digests:
            raise ValueError("ApiKeys needs at least one key")

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def accepts(self, key: str) -> bool:
        given = _digest(key)
        found = False
        for digest in self._digests:  # every digest, always: no early exit
            found |= hmac.compare_digest(given, digest)
        return found

    def refusal(self, authorization: str | None) -> str | None:
        if authorization is None:
            return "missing"
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or " " in token:
            return "malformed"
        return None if self.accepts(token) else "invalid"


Refuse = Callable[[dict, str], Callable[[dict, Callable, Callable], Awaitable[None]]]


class RequireApiKey:
    """ASGI middleware: answer `refuse(scope, reason)` (an ASGI response) to a request without a valid key.

    Checked before the body is read, so a caller without a key cannot make the server parse anything.
    Open: `open_paths`, and the OpenAPI pages (they describe the API and hold nothing secret)."""

    def __init__(self, app, keys: ApiKeys, open_paths: Iterable[str], refuse: Refuse):
        self.app, self.keys, self.refuse = app, keys, refuse
        self.open_paths = frozenset(open_paths) | DOCS_PATHS

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        header = values[0].decode("latin-1") if len(values) == 1 else None if not values else ""  # 2: malformed
        reason = self.keys.refusal(header)
        if reason is None:
            return await self.app(scope, receive, send)
        await self.refuse(scope, reason)(scope, receive, send)
