"""The digest of a uniform operation's result that hosts in lockstep compute alike.

Hosts other than the first answer a uniform operation (``Operation.uniform``) with
this digest instead of the result, and the coordinator compares it with the first
host's. It depends on the result's values alone, which pickles do not: pickle's memo
writes a string or tuple shared between leaves once and the same value made twice
in full, and cloudpickle gives a class it sends by value a random id per process, so
a :class:`~jaxpod.trees.Structure`'s recipe differs from host to host. A structure
counts by its type's name and its leaves' paths (its auxiliary data, in the recipe,
is host 0's on the coordinator whatever the others hold).

It covers what results are made of (nests of dicts, lists and tuples, frozen nodes,
value infos and scalars); for anything else there is no digest, and the host sends
its result whole.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jaxpod.operations import HandleInfo
from jaxpod.trees import KeyData, Structure

_SCALARS = frozenset({str, int, float, bool, type(None)})
_SEPARATOR = "\x1f"  # repr escapes it inside strings: parts cannot run together


class _Opaque(Exception):
    """A part of the result whose value this module does not know how to describe."""


def result_digest(result: Any) -> bytes | None:
    """16 bytes that equal results give on every host; ``None``: ``result`` holds
    something other than the types results are made of."""
    parts: list[str] = []
    try:
        _describe(result, parts)
    except (_Opaque, RecursionError):
        return None
    return hashlib.blake2b(_SEPARATOR.join(parts).encode(), digest_size=16).digest()


def _describe(x: Any, parts: list[str]) -> None:
    kind = type(x)
    if kind is HandleInfo:
        parts.append(f"H{x.id!r}{x.shape!r}{x.dtype!r}{x.valid_rows!r}{x.global_view!r}")
    elif kind in _SCALARS:
        parts.append(repr(x))
    elif kind is dict:
        parts.append("{")
        for key, item in x.items():
            _describe(key, parts)
            _describe(item, parts)
        parts.append("}")
    elif kind is list or kind is tuple:
        parts.append("[" if kind is list else "(")
        for item in x:
            _describe(item, parts)
        parts.append("]")
    elif kind is Structure:
        parts.append(f"S{x.type_name!r}{x.paths!r}")  # not the recipe (see above)
        _describe(x.leaves, parts)
    elif kind is KeyData:
        parts.append(f"K{x.impl!r}")
        _describe(x.data, parts)
    else:
        raise _Opaque(kind.__qualname__)
