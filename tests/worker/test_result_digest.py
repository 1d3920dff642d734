"""The digest hosts other than the first send for a uniform operation's result: equal
results give equal digests however their objects are shared or their recipes pickled,
and different ones differ."""

from __future__ import annotations

import pickle
from typing import Any

from jaxpod import operations as ops
from jaxpod.operations import HandleInfo
from jaxpod.trees import KeyData, Structure
from jaxpod.worker.result_digest import result_digest


def _infos(dtype: str, shape: tuple[int, ...], recipe: bytes = b"host 0") -> Any:
    return {"params": [HandleInfo(1, shape, dtype, None), HandleInfo(2, shape, dtype, None)],
            "opt": Structure(recipe, "optax.ScaleByAdamState", (("mu",), ("nu",)),
                             (HandleInfo(3, shape, dtype, (4, 4)),
                              KeyData("threefry2x32", HandleInfo(4, (2,), "uint32", None)))),
            "step": (None, 7, 0.5, True)}


def test_equal_results_digest_alike_however_they_were_made() -> None:
    # One host shares a dtype string and a shape tuple between leaves, another makes
    # each anew; cloudpickle gave their recipes different bytes. Their pickles differ,
    # their digests must not, or a host in step would be taken for one out of step.
    shared = _infos("float32", (512, 512))
    apart = _infos("".join(["float", "32"]), tuple([512, 512]), recipe=b"host 1")
    assert pickle.dumps(shared) != pickle.dumps(apart)
    assert result_digest(shared) == result_digest(apart)
    assert len(result_digest(shared) or b"") == 16


def test_results_that_differ_digest_apart() -> None:
    base = result_digest(_infos("float32", (512, 512)))
    assert base != result_digest(_infos("float32", (512, 511)))
    assert base != result_digest(_infos("bfloat16", (512, 512)))
    renamed = _infos("float32", (512, 512))
    renamed["opt"] = Structure(b"", "optax.ScaleByAdamState", (("mu",), ("nu2",)),
                               renamed["opt"].leaves)
    assert base != result_digest(renamed)
    # Containers and scalars count by kind too: a list is not a tuple, 1 is not "1".
    assert result_digest([1, 2]) != result_digest((1, 2))
    assert result_digest({"a": 1}) != result_digest({"a": "1"})
    assert result_digest(["a", "b"]) != result_digest(["a\x1f'b"])


def test_what_it_cannot_describe_has_no_digest() -> None:
    class Opaque:
        pass

    assert result_digest({"x": Opaque()}) is None
    looped: list[Any] = []
    looped.append(looped)
    assert result_digest(looped) is None


def test_only_operations_that_dispatch_are_uniform() -> None:
    # A host whose digest differs fails there alone: only a restart of the slice (which
    # follows a partial failure of an operation that dispatches) frees what it made.
    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    uniform = {c.__name__ for c in subclasses(ops.Operation) if c.uniform}
    assert {"Run", "RunSpmd", "RunSteps"} <= uniform
    assert all(c.dispatches for c in subclasses(ops.Operation) if c.uniform)
