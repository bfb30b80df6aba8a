"""What every request passes before a route: the body's size (BodyLimit), browsers' CORS
(Cors), the Host header (HostCheck: DNS rebinding), and one log line per request (AccessLog),
which no client can forge (LogFormatter)."""
import json
import logging
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from nano.server.schemas import error_response

log = logging.getLogger("nano.server")


def escape(text: str) -> str:
    """text with each character that is not printable (line breaks, ANSI escapes, every other
    control or separator character Unicode has) written as a Python string literal writes it:
    "\\n", "\\x1b", "\\u2028"."""
    if text.isprintable():  # the usual case, checked at C speed
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class LogFormatter(logging.Formatter):
    """The server's log lines, its own and uvicorn's. A record holds what clients sent (a path,
    a model's name, an error message that quotes a field), so the whole record is escaped: no
    client can end a line and write one that looks like the server's. A traceback is then one
    line too, its line breaks written "\\n"."""

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record))


def log_config(level: str) -> dict:
    """logging's configuration for uvicorn.Config: the server's logger and uvicorn's, each on
    stderr through LogFormatter under its own name (uvicorn writes its lines, most of them not
    errors, to "uvicorn.error": shown as "uvicorn"), at --log-level (uvicorn sets its own)."""
    names = (log.name, "uvicorn")
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {name: {"()": LogFormatter, "fmt": f"%(asctime)s %(levelname)s {name}: %(message)s"}
                           for name in names},
            "handlers": {name: {"class": "logging.StreamHandler", "formatter": name, "stream": "ext://sys.stderr"}
                         for name in names},
            "loggers": {log.name: {"handlers": [log.name], "propagate": False, "level": level.upper()},
                        "uvicorn": {"handlers": ["uvicorn"], "propagate": False}}}


class BodyLimit:
    """A request body over `limit` bytes gets 413 before it is parsed: one whose Content-Length
    says so at once, a chunked one once its bytes pass the limit. (FastAPI's max_body_size
    answers plain text, not OpenAI's error shape.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await error_response(self.message, 413)(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:  # raised while FastAPI reads the body: answered by the HTTPException handler
                raise HTTPException(413, self.message)
            return message
        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        return f"the request body is larger than this server's {self.limit} bytes"


class Cors(CORSMiddleware):
    """Starlette's CORS (CORSMiddleware: a browser's preflight answered, the Access-Control-*
    headers on every response, errors included), a refused preflight in OpenAI's error shape
    instead of Starlette's plain text."""

    def preflight_response(self, request_headers: Headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        return error_response(f"{response.body.decode()} (--allowed-origins, --allowed-methods, --allowed-headers)",
                              response.status_code, headers={k: v for k, v in response.headers.items()
                                                             if k.startswith("access-control-") or k == "vary"})


class HostCheck:
    """Starlette's Host header check (TrustedHostMiddleware), its refusal in OpenAI's error
    shape instead of Starlette's plain text."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope, receive, send):
        allowed = False

        async def passed(*_):
            nonlocal allowed
            allowed = True

        async def refused(_):  # Starlette's plain-text answer: not sent, ours is
            pass
        await TrustedHostMiddleware(passed, self.allowed_hosts, www_redirect=False)(scope, receive, refused)
        if allowed:
            return await self.app(scope, receive, send)
        await error_response("the Host header names a host this server does not answer for (--allowed-hosts)",
                             400)(scope, receive, send)


class AccessLog:
    """One line per request on the "nano.server" logger: method, path, status, milliseconds
    until the response's last byte (a stream's [DONE]) and, for an error, its message. Under
    2xx at INFO, 4xx at WARNING, 5xx at ERROR (--log-level picks what shows)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, body, failure = time.perf_counter(), 500, b"", None

        async def sending(message):
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and len(body) < 2**16:  # an error's body: small JSON
                body += message.get("body", b"")
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # a bug: answered 500 by Starlette's outermost middleware, after this
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            line = f"{scope['method']} {scope['path']} {status} {1e3 * (time.perf_counter() - start):.1f} ms"
            if failure or status >= 400:
                line += ": " + (failure or _reason(body))
            log.log(logging.ERROR if failure or status >= 500 else logging.WARNING if status >= 400
                    else logging.INFO, line)


def _reason(body: bytes) -> str:
    """An error response's message (OpenAI's shape), else its text."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")


def allowed_hosts(host: str, hosts: str | None) -> list[str]:
    """--allowed-hosts (comma-separated; '*': any). By default a server bound to one address
    answers only the names of that address and of loopback, so a web page whose name an attacker
    points at 127.0.0.1 (DNS rebinding) cannot reach it; one bound to every address takes any."""
    if hosts is not None:
        return [h.strip() for h in hosts.split(",") if h.strip()]
    if host in ("", "0.0.0.0", "::"):
        return ["*"]
    named = f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header writes it
    return list(dict.fromkeys(["localhost", "127.0.0.1", "[::1]", named]))


