"""Which Host names the HTTP front answers: the defence against DNS rebinding.

A web page on a name its owner controls can point that name at 127.0.0.1 after the page has loaded; the
browser then treats the server on its visitor's machine as the page's own origin, so the Origin check lets
it through and the page can read the replies. What the browser cannot change is the Host header: it stays
the attacker's name. So a server bound to a loopback address answers only loopback names (localhost and
*.localhost, which browsers resolve to loopback themselves) and IP literals (a URL of an address is no
rebinding), plus the names of --allowed-hosts; bound to any other address it is reached by names its
operator chose (a Kubernetes service, DNS), so every name is answered unless --allowed-hosts lists them."""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.http.errors import HostNotAllowed, error_body

MAX_SHOWN_CHARS = 100


def is_loopback(address: str) -> bool:
    """A bind address or a Host name that only reaches this machine."""
    name = address.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header, without its port, in lower case ("[::1]:8000" -> "::1")."""
    if header.startswith("["):
        return header[1 : header.find("]")].lower() if "]" in header else header.lower()
    return header.rpartition(":")[0].lower() if ":" in header else header.lower()


class HostCheck:
    """ASGI middleware: a request whose Host is not answered gets 403 host_not_allowed. `allowed`: the names
    of --allowed-hosts ("*": any); `bound_to_loopback`: whether the server listens on a loopback address."""

    def __init__(self, app: ASGIApp, allowed: set[str], bound_to_loopback: bool) -> None:
        self.app = app
        self.allowed = allowed
        self.check = "*" not in allowed and (bound_to_loopback or bool(allowed))

    def answers(self, header: str | None) -> bool:
        if not self.check or header is None:  # no Host: HTTP/1.0, not a browser
            return True
        name = host_name(header).rstrip(".")
        if name in self.allowed or is_loopback(name):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.answers(header):
                shown = (header or "")[:MAX_SHOWN_CHARS].encode("ascii", "backslashreplace").decode()
                exc = HostNotAllowed(
                    f"this server does not answer the name {shown!r} (--allowed-hosts names the ones it does, "
                    "besides localhost and IP addresses)"
                )
                await JSONResponse(error_body(exc), 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
