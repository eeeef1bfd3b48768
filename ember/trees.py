"""Nested containers of arrays (tuples, lists, dicts) flattened to leaves and back."""

from __future__ import annotations

from .array import Array


def flatten(tree, leaves: list):
    """The structure of ``tree`` with each array replaced by its index in ``leaves`` (appended);
    other values are kept in the structure (they must be hashable)."""
    if isinstance(tree, Array):
        leaves.append(tree)
        return ("array", len(leaves) - 1)
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(flatten(t, leaves) for t in tree))
    if isinstance(tree, dict):
        return ("dict", tuple((k, flatten(v, leaves)) for k, v in tree.items()))
    try:
        hash(tree)
    except TypeError:
        raise TypeError(f"expected arrays, containers of them, or hashable values; got {type(tree).__name__}") from None
    return ("static", tree)


def unflatten(structure, leaves):
    """The container ``structure`` describes, with its arrays taken from ``leaves``."""
    kind, body = structure
    if kind == "array":
        return leaves[body]
    if kind in ("list", "tuple"):
        items = [unflatten(s, leaves) for s in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: unflatten(s, leaves) for k, s in body}
    return body
