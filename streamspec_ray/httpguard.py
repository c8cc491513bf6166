"""What `streamspec serve` checks before a request reaches its handler, and the API key it checks against.

- The body limit: a Content-Length over it gets 413 without the body being parsed; a chunked body is counted as
  it is read (read_body) and refused once it passes the limit. No body larger than the limit is ever held: the
  rest is read and dropped for a moment (DRAIN_S), so a client still sending hears the 413 rather than a reset.
- Cross-site and DNS-rebinding requests (as Ollama's CVE-2024-28224): a web page the user visits can make the
  browser POST to 127.0.0.1, or rebind its own name to 127.0.0.1 and read the answers. Without an API key, a
  request whose Origin is not a loopback origin is refused (403); bound to a loopback address, the Host header
  must name a loopback address (403 otherwise: a rebound name is not one) and a POST must be
  `Content-Type: application/json` (415: a browser cannot send that cross-site without a CORS preflight, which
  this server never grants). With a key, Host and Content-Type are not checked: the key protects the server.

Errors are OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from .errors import ConfigError

KEY_ENV = "STREAMSPEC_API_KEY"
DEFAULT_MAX_BODY = 4 << 20  # 4 MiB: a prompt of about a million tokens' worth of text

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error"}


def error(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    """An OpenAI-shaped error response."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": _KINDS.get(status, "server_error"), "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def is_loopback(host: str | None) -> bool:
    """localhost, or an address in 127.0.0.0/8 or ::1 (brackets allowed)."""
    if not host:
        return False
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """A Host header's name: localhost:8000 -> localhost, [::1]:8000 -> ::1."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _loopback_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and is_loopback(parts.hostname)


class TooLarge(Exception):
    pass


def too_large(limit: int):
    # (Connection: close: the server does not read the rest of a body it refused)
    return error(413, f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
                 code="request_too_large", headers={"Connection": "close"})


# A refused body is still read (and dropped, chunk by chunk) for up to DRAIN_S seconds and DRAIN_MAX bytes before
# the 413 goes out, as nginx's lingering close does: a client still sending when the server closes gets a
# connection reset in place of the answer. Past either bound the answer goes out at once.
DRAIN_MAX = 64 << 20
DRAIN_S = 2.0


async def _bounded(chunks) -> None:
    """Drop what the async iterator `chunks` yields, within DRAIN_S seconds and DRAIN_MAX bytes."""
    import asyncio

    async def drop():
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > DRAIN_MAX:
                return
    try:
        await asyncio.wait_for(drop(), DRAIN_S)
    except asyncio.TimeoutError:
        pass


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused (TooLarge) as soon as more than `limit` bytes have arrived; the rest is
    dropped as it arrives (_bounded), never held."""
    size, parts, stream = 0, [], request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _bounded(stream)
            raise TooLarge
        parts.append(chunk)
    return b"".join(parts)


async def _received(receive):
    """The body chunks of an ASGI request, as receive() hands them."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        yield message.get("body", b"")
        if not message.get("more_body"):
            return


class Guard:
    """ASGI middleware: the checks above, before routing (a pure ASGI layer, so streaming responses and the
    handlers' wait for the client's disconnect pass through untouched)."""

    def __init__(self, app, *, local: bool, keyed: bool, max_body: int):
        self.app, self.local, self.keyed, self.max_body = app, local, keyed, max_body

    def refusal(self, method: str, headers: dict[str, str]):
        if not self.keyed:
            origin = headers.get("origin")
            if origin is not None and not _loopback_origin(origin):
                return error(403, f"cross-origin request refused: Origin {origin!r} is not a loopback origin "
                                  f"(a server with an API key accepts any origin)", code="origin_not_allowed")
            if self.local:
                host = headers.get("host", "")
                if not is_loopback(_host_of(host)):
                    return error(403, f"Host {host!r} is not a loopback address: this server, bound to a loopback "
                                      f"address without an API key, answers only requests addressed to localhost, "
                                      f"127.0.0.1 or [::1]", code="host_not_allowed")
                kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
                if method == "POST" and kind != "application/json":
                    return error(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                                 code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return too_large(self.max_body)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = self.refusal(scope["method"], headers)
            if refused is not None:
                if scope["method"] in ("POST", "PUT", "PATCH"):
                    await _bounded(_received(receive))
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def resolve_api_key(flag: str | None, path: str | None, environ=os.environ) -> str | None:
    """The server's key: --api-key, else the first line of --api-key-file, else $STREAMSPEC_API_KEY, else None.
    A key file that is missing or empty, or the variable set but empty, is an error rather than no key."""
    if flag is not None:
        if not flag.strip():
            raise ConfigError("--api-key is empty")
        return flag.strip()
    if path is not None:
        try:
            with open(path) as f:
                key = f.readline().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
        if not key:
            raise ConfigError(f"--api-key-file {path}: its first line is empty")
        return key
    if KEY_ENV in environ:
        key = environ[KEY_ENV].strip()
        if not key:
            raise ConfigError(f"${KEY_ENV} is set but empty")
        return key
    return None
