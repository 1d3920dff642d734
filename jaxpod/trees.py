"""Any JAX pytree, frozen for travel and thawed back where it is used.

The wire (:mod:`jaxpod.proto.tensors`) and the job store carry plain nests: dicts,
lists, tuples, ``None``, scalars and arrays. Everything else JAX can flatten travels
**frozen**, as one of two node types defined here:

* :class:`Structure`: a registered pytree node (``flax.nnx.State``, a
  ``flax.struct.dataclass``, a ``NamedTuple`` such as optax's states, a class
  registered with ``jax.tree_util.register_pytree_node``...) as its leaves plus a
  *recipe*: the cloudpickle of its nodes' types and auxiliary data, node by node (not
  of the ``PyTreeDef``, whose pickle assumes each type is registered the same way at
  both ends), with the registrations of the node types that live in the sender's own
  modules (they travel by value, as step functions do; the receiver registers them).
* :class:`KeyData`: a typed PRNG key array (``jax.random.key``) as its key data and
  the name of its implementation.

Only the ends that run user code freeze and thaw: the client and the host workers.
The coordinator carries frozen nodes as they are and never unpickles a recipe; both
node types are registered pytrees, so its tree maps reach the leaves inside them.

Recipes are cached by treedef on the sender and by their bytes on the receiver, so a
state passed from step to step costs one pickle per structure, not one per call.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import jax
import ml_dtypes
import numpy as np

#: Recipes kept by each cache (structures are few; each is a few KB).
_CACHE_SIZE = 1024


@dataclass(frozen=True)
class Structure:
    """A pytree of a type the receiver rebuilds: its recipe and its leaves.

    Attributes:
      recipe: what :func:`thaw` rebuilds the structure from (cloudpickle; only the
        client and the workers unpickle it).
      type_name: the root node's type (``module.QualName``), for messages.
      paths: each leaf's key path as names (``("params", "w", "value")``): errors name
        leaves with it, and a receiver that cannot import the type gets nested dicts.
      leaves: the leaves, in ``jax.tree.flatten`` order (frozen themselves).
    """

    recipe: bytes
    type_name: str
    paths: tuple[tuple[str, ...], ...]
    leaves: tuple[Any, ...]


@dataclass(frozen=True)
class KeyData:
    """A typed PRNG key array: its key data (``jax.random.key_data``) and the name of
    its implementation (``jax.random.key_impl``)."""

    impl: str
    data: Any


jax.tree_util.register_pytree_node(
    Structure, lambda s: (s.leaves, (s.recipe, s.type_name, s.paths)),
    lambda aux, leaves: Structure(*aux, tuple(leaves)))
jax.tree_util.register_pytree_node(
    KeyData, lambda k: ((k.data,), k.impl), lambda impl, data: KeyData(impl, data[0]))


_EXTRA_DTYPES = {name: np.dtype(getattr(ml_dtypes, name)) for name in (
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")}


def is_frozen(x: object) -> bool:
    return isinstance(x, Structure | KeyData)


def is_typed_key(x: object) -> bool:
    """Whether ``x`` is a (concrete or traced) array of typed PRNG keys."""
    return isinstance(x, jax.Array) and is_key_dtype(x.dtype)


# Both cached: numpy answers each afresh (1 and 6 us), and every operation on a host
# asks them of each of its outputs.
@functools.cache
def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


@functools.cache
def dtype_from_name(name: str) -> np.dtype[Any]:
    """The numpy dtype for a wire dtype name (``"float32"``, ``"bfloat16"``...)."""
    if name in _EXTRA_DTYPES:
        return _EXTRA_DTYPES[name]
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"Unknown tensor dtype {name!r} on the wire or in a store.") from None
    if dtype.hasobject:
        raise ValueError(f"Tensor dtype {name!r} cannot travel as raw bytes.")
    return dtype


def dtype_name(dtype: Any) -> str:
    """``str(dtype)``: the name a value's dtype travels by."""
    return str(dtype)


# --------------------------------------------------------------------------- freeze
def freeze(tree: Any, path: str = "value") -> Any:
    """``tree`` with every node other than dict, list, tuple and ``None`` frozen into a
    :class:`Structure`, and every concrete typed key array into :class:`KeyData`.
    Leaves of other types stay as they are (the caller decides what they mean).

    Raises:
      TypeError: a node's structure cannot be pickled (its auxiliary data holds a lock,
        a socket, an open file...), naming ``path`` and the node.
    """
    kind: type = type(tree)
    if kind is dict:
        return {k: freeze(v, f"{path}[{k!r}]") for k, v in tree.items()}
    if kind is list or kind is tuple:
        return kind(freeze(v, f"{path}[{i}]") for i, v in enumerate(tree))
    if tree is None or is_frozen(tree):
        return tree
    if is_typed_key(tree):
        return _key_data(tree)
    if jax.tree_util.all_leaves([tree]):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    recipe, paths = _recipe(treedef, tree, path)
    leaves = [_key_data(x) if is_typed_key(x) else x for x in leaves]
    return Structure(recipe, f"{kind.__module__}.{kind.__qualname__}", paths, tuple(leaves))


def _key_data(key: Any) -> KeyData:
    return KeyData(str(jax.random.key_impl(key)), np.asarray(jax.random.key_data(key)))


_recipes: collections.OrderedDict[Hashable, tuple[bytes, tuple[tuple[str, ...], ...]]] = \
    collections.OrderedDict()
_recipes_lock = threading.Lock()


def _recipe(treedef: Any, tree: Any, path: str) -> tuple[bytes, tuple[tuple[str, ...], ...]]:
    """The recipe and leaf paths of ``treedef`` (``tree``'s), cached by treedef."""
    with _recipes_lock:
        cached = _recipes.get(treedef)
        if cached is not None:
            _recipes.move_to_end(treedef)
            return cached
    paths = tuple(tuple(_key_name(k) for k in p)
                  for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    nodes = _describe(treedef)
    registrations = user_registrations(_node_types(nodes))
    try:
        recipe = cloudpickle.dumps((registrations, nodes))
    except Exception as e:
        raise TypeError(
            f"{path}: the structure of this {type(tree).__qualname__} cannot be sent "
            f"({type(e).__name__}: {e}). A pytree's auxiliary data (what its flatten "
            "function keeps beside the children) must pickle: keep locks, sockets, open "
            "files and similar objects out of it.") from e
    with _recipes_lock:
        _recipes[treedef] = (recipe, paths)
        if len(_recipes) > _CACHE_SIZE:
            _recipes.popitem(last=False)
    return recipe, paths


#: A treedef node by node: ``None`` for a leaf, else (type, aux data, children).
_Nodes = tuple[type, Any, list[Any]] | None


def _describe(treedef: Any) -> _Nodes:
    data = treedef.node_data()
    return None if data is None else (data[0], data[1],
                                      [_describe(c) for c in treedef.children()])


def _rebuild(nodes: _Nodes) -> Any:
    """The treedef ``nodes`` describes, built with this process's registrations."""
    from jax._src.tree_util import default_registry

    if nodes is None:
        return _LEAF
    kind, aux, children = nodes
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        default_registry, (kind, aux), [_rebuild(c) for c in children])


_LEAF = jax.tree.structure(0)


def _key_name(entry: Any) -> str:
    for attribute in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey...
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def _node_types(nodes: _Nodes) -> set[type]:
    found: set[type] = set()
    pending = [nodes]
    while pending:
        node = pending.pop()
        if node is not None:
            found.add(node[0])
            pending.extend(node[2])
    return found


# ------------------------------------------------------------ registrations
@dataclass(frozen=True)
class Registration:
    """A pytree node type and its flatten and unflatten functions, to register on a
    process that unpickled the type by value (its decorator did not run there)."""

    node_type: type
    flatten: Callable[[Any], Any]
    unflatten: Callable[[Any, Any], Any]


def user_registrations(types: set[type] | None = None) -> list[Registration]:
    """The registrations of pytree node types that cloudpickle sends by value (defined in
    ``__main__``, in a function, or in a module the workers cannot import): of ``types``
    only, or of every such registered type when ``None``."""
    from jax._src import tree_util  # the Python-side registry: flatten/unflatten by type

    from jaxpod.shipping import is_shipped_by_value

    registry: dict[type, Any] = tree_util._registry
    candidates = registry.keys() if types is None else types & registry.keys()
    return [Registration(t, registry[t].to_iter, registry[t].from_iter)
            for t in candidates if is_shipped_by_value(t)]


def register(registrations: Sequence[Registration]) -> None:
    """Registers each node type that is not registered yet in this process."""
    from jax._src import tree_util

    for r in registrations:
        if r.node_type not in tree_util._registry:
            jax.tree_util.register_pytree_node(r.node_type, r.flatten, r.unflatten)


# --------------------------------------------------------------------------- thaw
class RecipeError(TypeError):
    """A structure's recipe cannot be loaded here (its type's module is missing)."""


def thaw(tree: Any, leaf: Callable[[Any], Any] | None = None, *,
         unknown_as_dicts: bool = False, notes: list[str] | None = None) -> Any:
    """The user's objects a :func:`freeze` d tree stands for.

    Args:
      tree: a frozen tree.
      leaf: applied to every leaf that is not frozen (``None``: kept).
      unknown_as_dicts: a structure whose recipe cannot be loaded here (its type's
        module is not installed) becomes nested dicts keyed by its leaves' paths,
        instead of raising :class:`RecipeError`; ``notes`` gets a line saying so.
    """
    def go(x: Any) -> Any:
        kind = type(x)
        if kind is dict:
            return {k: go(v) for k, v in x.items()}
        if kind is list or kind is tuple:
            return kind(go(v) for v in x)
        if kind is KeyData:
            data = go(x.data)
            if not isinstance(data, np.ndarray | jax.Array):  # e.g. a handle's
                return data
            return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=x.impl)
        if kind is Structure:
            leaves = [go(v) for v in x.leaves]
            try:
                treedef = _load_recipe(x.recipe, x.type_name)
            except RecipeError as e:
                if not unknown_as_dicts:
                    raise
                if notes is not None:
                    notes.append(f"{e} It is returned as nested dicts keyed by its "
                                 "leaves' paths.")
                return _nested(x.paths, leaves)
            return jax.tree.unflatten(treedef, leaves)
        return x if leaf is None or x is None else leaf(x)

    return go(tree)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _load_recipe(recipe: bytes, type_name: str) -> Any:
    try:
        registrations, nodes = cloudpickle.loads(recipe)
        register(registrations)
        return _rebuild(nodes)
    except Exception as e:
        raise RecipeError(
            f"A {type_name} cannot be rebuilt in this process ({type(e).__name__}: {e}); "
            "install the package that defines it.") from e


def _nested(paths: Sequence[Sequence[str]], leaves: Sequence[Any]) -> Any:
    root: dict[str, Any] = {}
    for names, value in zip(paths, leaves, strict=True):
        node = root
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1] if names else ""] = value
    return root


# --------------------------------------------------------------------- wire forms
def paths_to_json(paths: Sequence[Sequence[str]]) -> list[str]:
    """Leaf paths as the wire and the job store keep them (one JSON list each)."""
    return [json.dumps(list(p)) for p in paths]


def paths_from_json(texts: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(str(n) for n in json.loads(t)) for t in texts)
