"""The job types of :mod:`jaxpod.jobs` as protobuf messages and back: the gRPC edge.

Each message mirrors its dataclass field by field, by name, so the conversion is
written once, here, for all of them: scalars and bytes as they are, a :class:`JobState`
as its name, a mapping as a map field, a sequence of dataclasses as a repeated message
field, a nested dataclass as a message field. A field that may be ``None`` is
``optional`` in the message (absent is ``None``); a mapping or sequence that may be
``None`` is ``None`` when empty. A field the message lacks, or a message field the dataclass
lacks, is an error at import time (:func:`check_mirrors`), not a value silently lost.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from jaxpod import jobs
from jaxpod.proto import coordinator_pb2 as pb

_T = TypeVar("_T")

#: Each job type and its message.
MESSAGES: dict[type, type[Message]] = {
    jobs.JobSpec: pb.JobSpec, jobs.JobStatus: pb.JobStatus, jobs.Transition: pb.JobTransition,
    jobs.Attempt: pb.JobAttempt, jobs.HostInput: pb.HostInput,
    jobs.JobCheckpoint: pb.JobCheckpoint, jobs.JobDetails: pb.JobDetails,
    jobs.JobProfile: pb.JobProfile, jobs.AuditRecord: pb.AuditRecord,
    jobs.HostStacks: pb.HostStacks}


def to_message(value: Any) -> Any:
    """``value`` (an instance of a type of :data:`MESSAGES`) as its message."""
    message = MESSAGES[type(value)]()
    for f, kind in _fields(type(value)):
        item = getattr(value, f.name)
        if item is None:
            continue
        if kind.is_map:
            getattr(message, f.name).update(item)
        elif kind.repeated:
            getattr(message, f.name).extend(
                [to_message(x) for x in item] if kind.item is not None else item)
        elif kind.item is not None:
            getattr(message, f.name).CopyFrom(to_message(item))
        else:
            setattr(message, f.name, item.value if isinstance(item, jobs.JobState) else item)
    return message


def from_message(cls: type[_T], message: Any) -> _T:
    """The ``cls`` instance ``message`` (its message type) stands for."""
    values: dict[str, Any] = {}
    for f, kind in _fields(cls):
        raw = getattr(message, f.name)
        if kind.is_map:
            values[f.name] = dict(raw) if raw or not kind.optional else None
        elif kind.repeated:
            items = [from_message(kind.item, x) for x in raw] if kind.item else list(raw)
            values[f.name] = kind.sequence(items) if items or not kind.optional else None
        elif kind.optional and not message.HasField(f.name):
            values[f.name] = None
        elif kind.item is not None:
            values[f.name] = from_message(kind.item, raw)
        else:
            values[f.name] = kind.scalar(raw)
    return cls(**values)


def _same(x: Any) -> Any:
    return x


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one dataclass field maps to its message field."""

    optional: bool
    is_map: bool = False
    repeated: bool = False
    item: Any = None             # the dataclass of a message field (or of its items)
    sequence: Any = tuple        # what a repeated field becomes (tuple or list)
    scalar: Any = _same          # what a scalar field becomes (e.g. JobState)

    @property
    def container(self) -> bool:
        return self.is_map or self.repeated


_FIELDS: dict[type, tuple[tuple[dataclasses.Field[Any], _Kind], ...]] = {}


def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], _Kind], ...]:
    """``cls``'s fields, each with how it maps (worked out once per type)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = _mapped_fields(cls)
    return _FIELDS[cls]


def _mapped_fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], _Kind], ...]:
    hints = typing.get_type_hints(cls)
    message = MESSAGES[cls].DESCRIPTOR
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args
        if optional:
            (hint,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(hint) or hint
        target = message.fields_by_name[f.name]
        if isinstance(origin, type) and issubclass(origin, Mapping):
            kind = _Kind(optional, is_map=True)
        elif isinstance(origin, type) and issubclass(origin, Sequence) and not issubclass(
                origin, str | bytes):
            item = typing.get_args(hint)[0]
            kind = _Kind(optional, repeated=True,
                         item=item if item in MESSAGES else None,
                         sequence=tuple if origin is tuple else list)
        elif hint in MESSAGES:
            kind = _Kind(optional, item=hint)
        else:
            kind = _Kind(optional, scalar=hint if hint is jobs.JobState else _same)
        _check_field(cls, f.name, kind, target)
        out.append((f, kind))
    return tuple(out)


def _check_field(cls: type, name: str, kind: _Kind, target: FieldDescriptor) -> None:
    is_map = target.message_type is not None and target.message_type.GetOptions().map_entry
    repeated = not is_map and target.is_repeated
    if (kind.is_map, kind.repeated) != (is_map, repeated) or (
            kind.optional and not (kind.container or target.has_presence)):
        raise TypeError(f"{cls.__name__}.{name} does not match {target.full_name}: a "
                        f"{'map' if is_map else 'repeated' if repeated else 'single'} "
                        f"field{'' if target.has_presence else ' without presence'}. Make "
                        "the message field say the same (optional for a field that may be "
                        "None) and regenerate the modules.")


def check_mirrors() -> None:
    """Every type's fields and its message's fields are the same names, each mapped."""
    for cls, message in MESSAGES.items():
        ours = {f.name for f in dataclasses.fields(cls)}
        theirs = set(message.DESCRIPTOR.fields_by_name)
        if ours != theirs:
            raise TypeError(f"{cls.__name__} and {message.DESCRIPTOR.full_name} differ: "
                            f"only the dataclass has {sorted(ours - theirs)}, only the "
                            f"message {sorted(theirs - ours)}.")
        _fields(cls)


check_mirrors()
