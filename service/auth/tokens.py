"""Who may call the service: named tokens with roles (DESIGN §9).

A tokens file (``jaxpod serve --tokens-file FILE``) is TOML, one ``[[token]]`` table
per token, holding the SHA-256 of the token, never the token itself::

    [[token]]
    name = "alice"          # owner of what this token creates
    role = "submitter"      # viewer | submitter | admin
    sha256 = "9f86d0..."    # hex SHA-256 of the token
    max_slices = 2          # optional: slices its strategies and jobs hold at once
    team = "research"       # optional: the team its jobs count against

    [[team]]                # optional: the teams sharing the slices (jaxpod.service.auth.teams)
    name = "research"
    weight = 2              # its share of contended slices, against the others' weights
    guaranteed = { "v4-16" = 1 }  # optional: slices it may reclaim whatever its share

A team a token names must have its ``[[team]]`` table. The service re-reads the file
when it changes (at most every ``RELOAD_EVERY_S``): a new token, team or weight takes
effect without a restart; a file that no longer loads is logged and the last good one
kept.

``$JAXPOD_TOKEN`` alone is one admin token named ``admin``; a service started with no
token (loopback only) treats every caller as the admin :data:`LOCAL`.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import os
import re
import secrets
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpod.errors import PermissionDeniedError
from jaxpod.service.auth.teams import DEFAULT_TEAM, Team, parse_team

logger = logging.getLogger(__name__)

#: How often, at most, a service looks whether its tokens file changed.
RELOAD_EVERY_S = 1.0

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class Role(enum.IntEnum):
    """What a token may do; each role may also do everything of the roles below it.

    * ``viewer``: read the cluster, the job list, job status, metrics and the page.
    * ``submitter``: also open strategies, submit jobs, and cancel, read the results
      and logs of its own jobs.
    * ``admin``: everything, to every job.
    """

    VIEWER = 1
    SUBMITTER = 2
    ADMIN = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role named ``text``.

        Raises:
          ValueError: no such role (the message lists them).
        """
        try:
            return cls[str(text).upper()]
        except KeyError:
            raise ValueError(f"unknown role {text!r}: expected one of "
                             f"{', '.join(str(r) for r in cls)}.") from None


@dataclass(frozen=True)
class Principal:
    """A caller, as its token names it.

    Attributes:
      name: the token's name, recorded as the owner of what it creates.
      role: what it may do.
      max_slices: the slices its strategies and jobs may hold at once (``None``: no cap).
      team: the team its jobs count against.
    """

    name: str
    role: Role
    max_slices: int | None = None
    team: str = DEFAULT_TEAM

    def may(self, needed: Role) -> bool:
        return self.role >= needed

    def require(self, needed: Role, what: str) -> None:
        """Raises :class:`PermissionDeniedError` unless this caller has ``needed``."""
        if not self.may(needed):
            raise PermissionDeniedError(denial(self, needed, what))

    def owns(self, owner: str) -> bool:
        """Whether this caller may act on something ``owner`` created: its own, or
        anyone's for an admin."""
        return self.role is Role.ADMIN or self.name == owner


#: The caller of a service started without tokens (it listens on loopback only).
LOCAL = Principal("local", Role.ADMIN)


def denial(who: Principal, needed: Role, what: str) -> str:
    """The message of a refusal: what was refused, the role it needs, how to get it."""
    return (f"{what} needs the {needed} role; the token {who.name!r} has the {who.role} "
            f"role. Ask an admin of this service for a token with the {needed} role "
            f"(jaxpod token new NAME --role {needed} --tokens-file FILE).")


@dataclass(frozen=True)
class _Entry:
    principal: Principal
    digest: bytes  # SHA-256 of the token


class _Book:
    """One version of the tokens file, read."""

    def __init__(self, entries: Sequence[tuple[Principal, bytes]],
                 teams: Mapping[str, Team]) -> None:
        self.entries = tuple(_Entry(p, d) for p, d in entries)
        # Looked up by the SHA-256 of the token presented: what a lookup's time could
        # reveal is about that hash, which says nothing about the tokens (finding a
        # token from it is a preimage), so one dict serves any number of tokens.
        self.by_digest = {e.digest: e.principal for e in self.entries}
        self.by_name = {e.principal.name: e for e in self.entries}
        self.teams = dict(teams)


class TokenBook:
    """The tokens a service accepts, who each one is, and the teams they form. One
    loaded from a file follows the file's changes."""

    def __init__(self, entries: Sequence[tuple[Principal, bytes]],
                 teams: Mapping[str, Team] | None = None,
                 source: Path | None = None) -> None:
        self._book = _Book(entries, teams or {})
        self._source = source
        self._seen = _stamp(source) if source is not None else None
        self._next_look = time.monotonic() + RELOAD_EVERY_S
        self._lock = threading.Lock()

    @classmethod
    def single(cls, token: str) -> TokenBook:
        """``$JAXPOD_TOKEN`` alone: one admin token named ``admin``."""
        return cls([(Principal("admin", Role.ADMIN), _digest(token))])

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenBook:
        """Reads a tokens file (and follows its changes).

        Raises:
          ValueError: it cannot be read, is not TOML, or an entry is wrong; the message
            names the file, the entry and the fix.
        """
        where = Path(path).expanduser()
        entries, teams = _read(where)
        return cls(entries, teams, source=where)

    def _current(self) -> _Book:
        """The book, re-read first if its file changed (looked at most every
        RELOAD_EVERY_S)."""
        if self._source is None or time.monotonic() < self._next_look:
            return self._book
        with self._lock:
            if time.monotonic() < self._next_look:
                return self._book
            self._next_look = time.monotonic() + RELOAD_EVERY_S
            stamp = _stamp(self._source)
            if stamp == self._seen:
                return self._book
            self._seen = stamp
            try:
                self._book = _Book(*_read(self._source))
            except ValueError as e:
                logger.error("the tokens file changed but does not load; the last good "
                             "one stays in use: %s", e)
            else:
                logger.info("re-read the tokens file %s: tokens %s, teams %s",
                            self._source, ", ".join(self.names),
                            ", ".join(self._book.teams) or "none")
        return self._book

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.principal.name for e in self._book.entries)

    def teams(self) -> dict[str, Team]:
        """The declared teams, by name (empty: none declared; every job is in the
        default team)."""
        return dict(self._current().teams)

    def identify(self, token: str | bytes | None) -> Principal | None:
        """The caller ``token`` belongs to, or ``None``: looked up by its SHA-256, so
        response times say nothing about the tokens."""
        return self._current().by_digest.get(_digest(token)) if token else None

    def identify_bearer(self, header: str | bytes | None) -> Principal | None:
        """:meth:`identify` for an ``authorization: Bearer <token>`` value."""
        value = header.decode(errors="replace") if isinstance(header, bytes) else header
        if not value or not value.startswith("Bearer "):
            return None
        return self.identify(value[len("Bearer "):])

    def digest_of(self, name: str) -> bytes | None:
        """The token digest recorded for ``name`` (``None``: no such token)."""
        entry = self._current().by_name.get(name)
        return entry.digest if entry is not None else None

    def principal(self, name: str) -> Principal | None:
        entry = self._current().by_name.get(name)
        return entry.principal if entry is not None else None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def _read(where: Path) -> tuple[list[tuple[Principal, bytes]], dict[str, Team]]:
    try:
        data = tomllib.loads(where.read_text())
    except OSError as e:
        raise ValueError(f"--tokens-file {str(where)!r}: cannot read it "
                         f"({e.strerror}).") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--tokens-file {str(where)!r} is not valid TOML: {e}.") from None
    tables = data.get("token", [])
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"--tokens-file {str(where)!r} has no [[token]] tables; add "
                         "one with `jaxpod token new NAME --role ROLE --tokens-file "
                         f"{where}`.")
    entries = [_parse_entry(where, f"[[token]] #{i + 1}", t) for i, t in enumerate(tables)]
    team_tables = data.get("team", [])
    if not isinstance(team_tables, list):
        raise ValueError(f"--tokens-file {str(where)!r}: team must be [[team]] tables.")
    teams = [parse_team(f"--tokens-file {str(where)!r}, [[team]] #{i + 1}", t)
             for i, t in enumerate(team_tables)]
    for kind, table, values in (("name", "token", [p.name for p, _ in entries]),
                                ("sha256", "token", [d.hex() for _, d in entries]),
                                ("name", "team", [t.name for t in teams])):
        repeated = sorted(v for v, n in collections.Counter(values).items() if n > 1)
        if repeated:
            raise ValueError(f"--tokens-file {str(where)!r}: {kind} {repeated[0]!r} "
                             f"appears in more than one [[{table}]]; each must be unique.")
    declared = {t.name: t for t in teams}
    for principal, _ in entries:
        if principal.team != DEFAULT_TEAM and principal.team not in declared:
            raise ValueError(
                f"--tokens-file {str(where)!r}: the token {principal.name!r} names the team "
                f"{principal.team!r}, which has no [[team]] table (teams: "
                f"{', '.join(declared) or 'none'}). Add one (name = \"{principal.team}\", "
                "weight = 1) or fix the name.")
    return entries, declared


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def _parse_entry(where: Path, label: str, table: Any) -> tuple[Principal, bytes]:
    def wrong(problem: str) -> ValueError:
        return ValueError(f"--tokens-file {str(where)!r}, {label}: {problem}")

    if not isinstance(table, dict):
        raise wrong("is not a table.")
    unknown = sorted(set(table) - {"name", "role", "sha256", "max_slices", "team"})
    if unknown:
        raise wrong(f"unknown key {unknown[0]!r}; the keys are name, role, sha256, "
                    "max_slices and team.")
    name, role, sha = table.get("name"), table.get("role"), table.get("sha256")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise wrong(f"name {name!r} must be 1-64 letters, digits or ._@- characters.")
    if not isinstance(sha, str) or not _SHA256_RE.match(sha):
        raise wrong(f"sha256 of {name!r} must be 64 lowercase hex digits (the SHA-256 of "
                    "the token, never the token itself).")
    try:
        parsed = Role.parse(str(role))
    except ValueError as e:
        raise wrong(f"{name!r}: {e}") from None
    limit = table.get("max_slices")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 0):
        raise wrong(f"max_slices of {name!r} must be a whole number >= 0; got {limit!r}.")
    team = table.get("team", DEFAULT_TEAM)
    if not isinstance(team, str) or not _NAME_RE.match(team):
        raise wrong(f"team of {name!r} must be 1-64 letters, digits or ._@- characters; "
                    f"got {team!r}.")
    return Principal(name, parsed, limit, team), bytes.fromhex(sha)


def new_token(path: str | os.PathLike[str], name: str, role: Role | str,
              max_slices: int | None = None, team: str | None = None) -> str:
    """Appends a new token to the tokens file (created, readable by its owner only, if
    missing) and returns the token: the file keeps only its SHA-256. A ``team`` the
    file does not declare yet gets a ``[[team]]`` table of weight 1.

    Raises:
      ValueError: a bad name, role or quota, the name is taken, or the file is broken.
    """
    where = Path(path).expanduser()
    parsed = role if isinstance(role, Role) else Role.parse(role)
    token = secrets.token_urlsafe(32)
    entry: dict[str, Any] = {"name": name, "role": str(parsed),
                             "sha256": hashlib.sha256(token.encode()).hexdigest()}
    if max_slices is not None:
        entry["max_slices"] = max_slices
    if team is not None:
        entry["team"] = team
    _parse_entry(where, "the new token", entry)  # the same checks as loading it
    declared: dict[str, Team] = {}
    if where.exists() and where.stat().st_size:
        book = TokenBook.load(where)
        if name in book.names:
            raise ValueError(f"--tokens-file {str(where)!r} already has a token named "
                             f"{name!r}; pick another name, or remove its [[token]] "
                             "table first.")
        declared = book.teams()
    lines = ["", "[[token]]"] + [f"{k} = {_toml_value(v)}" for k, v in entry.items()]
    if team is not None and team != DEFAULT_TEAM and team not in declared:
        lines += ["", "[[team]]", f"name = {_toml_value(team)}", "weight = 1"]
    fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("\n".join(lines) + "\n")
    return token


def _toml_value(value: Any) -> str:
    return str(value) if isinstance(value, int) else f'"{value}"'
