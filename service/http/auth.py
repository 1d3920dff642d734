"""Who may use the HTTP side: the service's bearer token, or a session cookie from
``/login``.

* With no token configured the service listens on loopback only
  (:func:`jaxpod.service.serve_cli.check_listen_address`) and every route is open.
* Else every route but ``/healthz`` and ``/readyz`` (and the sign-in form itself)
  needs ``Authorization: Bearer <token>`` or the cookie the form sets. The cookie holds
  an HMAC of the token, not the token: it is HttpOnly (no script reads it) and
  SameSite=Strict (no other site's page sends it). Comparisons take constant time.
* State-changing requests (anything but GET/HEAD/OPTIONS) that carry an ``Origin``
  must come from the dashboard's own origin; with the cookie they must carry one (a
  browser always does), so another site cannot cancel jobs through a signed-in browser.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from fastapi import Request

COOKIE = "jaxpod_session"
#: Routes anyone may reach: the probes and the sign-in form.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/login", "/logout"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Auth:
    """The checks for one token (``None``: open)."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self._bearer = f"Bearer {token}".encode() if token else b""
        # What the cookie holds: a digest of the token, so a leaked cookie jar does not
        # leak the token gRPC clients use (the cookie works only here).
        self.cookie_value = (hmac.new(token.encode(), b"jaxpod-dashboard-session",
                                      hashlib.sha256).hexdigest() if token else "")

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def token_matches(self, given: str) -> bool:
        return bool(self.token) and hmac.compare_digest(given.encode(),
                                                        str(self.token).encode())

    def how(self, request: Request) -> str | None:
        """``"bearer"``, ``"cookie"`` or ``"open"`` when the request may go on, else
        ``None``."""
        if not self.enabled:
            return "open"
        header = request.headers.get("authorization", "")
        if header and hmac.compare_digest(header.encode(), self._bearer):
            return "bearer"
        cookie = request.cookies.get(COOKIE, "")
        if cookie and hmac.compare_digest(cookie.encode(), self.cookie_value.encode()):
            return "cookie"
        return None


def is_open(path: str) -> bool:
    return path in OPEN_PATHS


def origin_problem(request: Request, how: str) -> str | None:
    """Why a state-changing request's origin is refused, or ``None`` when it is fine."""
    if request.method in SAFE_METHODS:
        return None
    origin = request.headers.get("origin")
    if origin is None and how == "cookie":
        referer = request.headers.get("referer")
        if referer is None:
            return ("a request signed in by cookie must carry an Origin (or Referer) "
                    "header; browsers send one")
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    if origin is None:
        return None  # not a browser (curl, the SDK with a bearer token)
    own = f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
    if origin != own:
        return f"the request came from {origin!r}, not from this dashboard ({own!r})"
    return None
