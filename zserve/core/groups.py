"""Group request ids (or batch rows) by the frontend that must hear about them.

Plans, drop notices and shed queues carry parallel lists: a request id and, for each, the
frontend it came from (an index into the plan's ``frontends``, or the frontend's address).
Every role that answers or drops several requests at once sends one message per frontend;
:func:`group_by_frontend` is that grouping, with a fast path for the common single-frontend case.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def group_by_frontend(values: Sequence[V], frontend_of: Sequence[K]) -> dict[K, list[V]]:
    """``{frontend: [values from it, in order]}`` for parallel ``values`` and ``frontend_of``
    (pass ``range(len(frontend_of))`` as ``values`` to group batch rows)."""
    if len(values) != len(frontend_of):
        raise ValueError(f"{len(values)} values but {len(frontend_of)} frontends")
    if not values:
        return {}
    first = frontend_of[0]
    if frontend_of.count(first) == len(frontend_of):  # one frontend: no per-item work
        return {first: list(values)}
    groups: dict[K, list[V]] = {}
    for value, key in zip(values, frontend_of, strict=True):
        group = groups.get(key)
        if group is None:
            groups[key] = [value]
        else:
            group.append(value)
    return groups


__all__ = ["group_by_frontend"]
