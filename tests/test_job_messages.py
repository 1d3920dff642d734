"""The gRPC edge of the job types: every type of ``jaxpod.jobs`` that travels converts to
its message and back unchanged, for any values its fields can hold (hypothesis), and a
type and its message cannot drift apart unnoticed."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpod import jobs
from jaxpod.proto import coordinator_pb2 as pb
from jaxpod.proto import job_messages

_INT32 = st.integers(0, 2**31 - 1)
_FLOAT = st.floats(allow_nan=False, allow_infinity=False)


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of ``hint`` that the wire can carry (int32 range, finite floats)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(inner)
    origin = typing.get_origin(hint) or hint
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
    if isinstance(origin, type) and issubclass(origin, Mapping):
        return st.dictionaries(st.text(max_size=8), strategy_for(args[1]), max_size=3)
    if dataclasses.is_dataclass(hint):
        return of(hint)
    return {int: _INT32, float: _FLOAT, str: st.text(max_size=12), bool: st.booleans(),
            bytes: st.binary(max_size=16), jobs.JobState: st.sampled_from(jobs.JobState)
            }[hint]


def of(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name])
                             for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", list(job_messages.MESSAGES), ids=lambda c: c.__name__)
def test_every_job_type_round_trips_through_its_message(cls: type) -> None:
    @settings(max_examples=60, deadline=None)
    @given(of(cls))
    def round_trip(value: Any) -> None:
        message = job_messages.to_message(value)
        wire = type(message).FromString(message.SerializeToString())
        back = job_messages.from_message(cls, wire)
        # An empty mapping or sequence that may be None travels as None: the message
        # cannot tell.
        assert back == _empties_as_none(value)

    round_trip()


def _empties_as_none(value: Any) -> Any:
    hints = typing.get_type_hints(type(value))
    changes = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        hint = hints[f.name]
        optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
        if optional and isinstance(item, Mapping | tuple | list) and not item:
            changes[f.name] = None
        elif dataclasses.is_dataclass(item):
            changes[f.name] = _empties_as_none(item)
        elif isinstance(item, tuple) and item and dataclasses.is_dataclass(item[0]):
            changes[f.name] = tuple(_empties_as_none(x) for x in item)
    return dataclasses.replace(value, **changes)


def test_a_type_and_its_message_that_differ_are_refused(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    @dataclasses.dataclass(frozen=True)
    class Drifted:
        step: int
        path: str
        saved_at: float
        extra: int = 0

    monkeypatch.setitem(job_messages.MESSAGES, Drifted, pb.JobCheckpoint)
    with pytest.raises(TypeError, match=r"only the dataclass has \['extra'\]"):
        job_messages.check_mirrors()


def test_a_field_that_may_be_none_needs_presence_on_the_wire(
        monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Loose:
        step: int | None  # JobCheckpoint.step has no presence
        path: str
        saved_at: float
        stall_s: float | None

    monkeypatch.setitem(job_messages.MESSAGES, Loose, pb.JobCheckpoint)
    with pytest.raises(TypeError, match=r"Loose\.step does not match .*optional"):
        job_messages.check_mirrors()
