"""Who may use the HTTP side: a bearer token of the service's token book, or a session
cookie from ``/login``; what each route needs is :data:`jaxpod.service.auth.roles.ROUTE_ROLES`.

* With no tokens the service listens on loopback only
  (:func:`jaxpod.service.cli.serve.check_listen_address`) and every caller is the admin
  :data:`~jaxpod.service.auth.tokens.LOCAL`.
* Else a route that needs a role needs ``Authorization: Bearer <token>`` or the cookie
  the form sets. The cookie holds the token's name and an HMAC keyed by the token's
  SHA-256, not the token: it is HttpOnly (no script reads it) and SameSite=Strict (no
  other site's page sends it), and it stops working when the token leaves the tokens
  file. Comparisons take constant time.
* State-changing requests (anything but GET/HEAD/OPTIONS) that carry an ``Origin``
  must come from the dashboard's own origin; with the cookie they must carry one (a
  browser always does), so another site cannot cancel jobs through a signed-in browser.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from fastapi import Request

from jaxpod.service.auth.tokens import LOCAL, Principal, TokenBook

COOKIE = "jaxpod_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_COOKIE_MESSAGE = b"jaxpod-dashboard-session"


class Auth:
    """Who a request comes from, for one token book (``None``: open)."""

    def __init__(self, tokens: TokenBook | None) -> None:
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def identify(self, request: Request) -> tuple[str, Principal] | None:
        """How the request proved who it is (``"bearer"``, ``"cookie"`` or ``"open"``)
        and who that is; ``None`` when it did not."""
        if self.tokens is None:
            return "open", LOCAL
        who = self.tokens.identify_bearer(request.headers.get("authorization"))
        if who is not None:
            return "bearer", who
        who = self.from_cookie(request.cookies.get(COOKIE, ""))
        return ("cookie", who) if who is not None else None

    def login(self, token: str) -> Principal | None:
        """Who ``token`` (typed into the sign-in form) belongs to."""
        return LOCAL if self.tokens is None else self.tokens.identify(token)

    def cookie_for(self, who: Principal) -> str:
        """The session cookie of ``who``: its name and a MAC keyed by its token's hash."""
        return f"{who.name}.{self._mac(who.name)}"

    def from_cookie(self, value: str) -> Principal | None:
        name, _, mac = value.rpartition(".")
        expected = self._mac(name) if name else ""
        if not expected or not hmac.compare_digest(mac.encode(), expected.encode()):
            return None
        return self.tokens.principal(name) if self.tokens is not None else None

    def _mac(self, name: str) -> str:
        digest = self.tokens.digest_of(name) if self.tokens is not None else None
        if digest is None:
            return ""
        return hmac.new(digest, _COOKIE_MESSAGE, hashlib.sha256).hexdigest()


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
