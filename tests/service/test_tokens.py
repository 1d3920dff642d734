"""The tokens file: what ``jaxpod token new`` writes and ``TokenBook.load`` accepts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from jaxpod.service.auth.tokens import LOCAL, Principal, Role, TokenBook, new_token

SHA = hashlib.sha256(b"t0ken").hexdigest()


def _write(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_new_tokens_round_trip_and_keep_only_hashes(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tokens.toml"
    path.parent.mkdir()
    alice = new_token(path, "alice", "submitter", max_slices=2)
    root = new_token(path, "root", Role.ADMIN)
    assert alice != root and alice not in path.read_text() and root not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    book = TokenBook.load(path)
    assert book.names == ("alice", "root")
    assert book.identify(alice) == Principal("alice", Role.SUBMITTER, 2)
    assert book.identify(root) == Principal("root", Role.ADMIN)
    assert book.identify_bearer(f"Bearer {alice}".encode()) == book.identify(alice)
    for wrong in (None, "", alice[:-1], alice + "x", f"Basic {alice}"):
        assert book.identify(wrong) is None and book.identify_bearer(wrong) is None
    with pytest.raises(ValueError, match="already has a token named 'alice'"):
        new_token(path, "alice", "viewer")
    with pytest.raises(ValueError, match="unknown role 'owner'"):
        new_token(path, "carol", "owner")
    assert TokenBook.load(path).names == ("alice", "root")  # nothing half-written


@pytest.mark.parametrize("body, message", [
    ("", "has no \\[\\[token\\]\\] tables"),
    ("[[token]\n", "is not valid TOML"),
    (f'[[token]]\nname = "a"\nrole = "viewer"\nsha256 = "{SHA}"\ntoken = "t0ken"\n',
     "#1: unknown key 'token'"),
    (f'[[token]]\nname = "a b"\nrole = "viewer"\nsha256 = "{SHA}"\n', "name 'a b'"),
    ('[[token]]\nname = "a"\nrole = "viewer"\nsha256 = "t0ken"\n', "64 lowercase hex"),
    (f'[[token]]\nname = "a"\nrole = "root"\nsha256 = "{SHA}"\n', "unknown role 'root'"),
    (f'[[token]]\nname = "a"\nrole = "viewer"\nsha256 = "{SHA}"\nmax_slices = -1\n',
     "max_slices of 'a'"),
    (f'[[token]]\nname = "a"\nrole = "viewer"\nsha256 = "{SHA}"\n'
     f'[[token]]\nname = "a"\nrole = "admin"\nsha256 = "{"0" * 64}"\n',
     "name 'a' appears in more than one"),
    (f'[[token]]\nname = "a"\nrole = "viewer"\nsha256 = "{SHA}"\n'
     f'[[token]]\nname = "b"\nrole = "admin"\nsha256 = "{SHA}"\n',
     "sha256 .* appears in more than one"),
])
def test_a_wrong_tokens_file_names_the_entry_and_the_fix(tmp_path: Path, body: str,
                                                         message: str) -> None:
    path = _write(tmp_path / "tokens.toml", body)
    with pytest.raises(ValueError, match=message) as refused:
        TokenBook.load(path)
    assert str(path) in str(refused.value)


def test_roles_are_ordered_and_ownership_is_the_owners_or_an_admins() -> None:
    viewer, alice = Principal("v", Role.VIEWER), Principal("alice", Role.SUBMITTER)
    assert viewer.may(Role.VIEWER) and not viewer.may(Role.SUBMITTER)
    assert alice.may(Role.SUBMITTER) and not alice.may(Role.ADMIN)
    assert alice.owns("alice") and not alice.owns("bob") and not alice.owns("")
    assert LOCAL.owns("bob") and LOCAL.role is Role.ADMIN
    assert TokenBook.single("s").identify("s") == Principal("admin", Role.ADMIN)
    assert [str(r) for r in Role] == ["viewer", "submitter", "admin"]
