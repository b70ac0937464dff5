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
import logging
import re
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.http.errors import HostNotAllowed, error_body

MAX_SHOWN_CHARS = 100
log = logging.getLogger("service.http")
# a name or a bracketed IPv6 address, then an optional port of digits: what a browser's URL parser sends
HOST_HEADER = re.compile(r"(\[[^\]]*\]|[^:\[\]]*)(:\d*)?")


def is_loopback(address: str) -> bool:
    """A bind address or a Host name that only reaches this machine."""
    name = address.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str | None:
    """The name of a Host header, without its port, in lower case ("[::1]:8000" -> "::1"); None for a header
    that is not a name and a port of digits."""
    match = HOST_HEADER.fullmatch(header)
    if match is None:
        return None
    return match.group(1).strip("[]").lower()


class HostCheck:
    """ASGI middleware: a request whose Host is not answered gets 403 host_not_allowed. `allowed`: the names
    of --allowed-hosts ("*": any); `bound_to_loopback`: whether the server listens on a loopback address."""

    def __init__(
        self, app: ASGIApp, allowed: set[str], bound_to_loopback: bool, count: Callable[[], None] = lambda: None
    ) -> None:
        self.app = app
        self.allowed = allowed
        self.count = count  # a refusal, in the server's metrics
        self.check = "*" not in allowed and (bound_to_loopback or bool(allowed))

    def answers(self, header: str | None) -> bool:
        if not self.check or header is None:  # no Host: HTTP/1.0, not a browser
            return True
        name = host_name(header)
        if name is None:
            return False
        name = name.rstrip(".")
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
                shown = (header or "")[:MAX_SHOWN_CHARS].encode("unicode_escape").decode()
                exc = HostNotAllowed(
                    f"this server does not answer the name '{shown}' (--allowed-hosts names the ones it does, "
                    "besides localhost and IP addresses)"
                )
                log.info("request refused: %s", exc)
                self.count()
                await JSONResponse(error_body(exc), 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
