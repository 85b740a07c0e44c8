"""Optimizer parameter lists that code outside torch collapsed by ``data_ptr()``, put back where
the original lists are provable.

Accelerate's ``prepare`` re-points an optimizer at a model's parameters by
``_local_tensor.data_ptr()``. torch returns 0 for the data pointer of every tensor without
elements, and under mfsdp2's row-aligned layout a rank holds no rows of many parameters, so on
that rank all of them map to one (call it ``D``): the optimizer holds ``D`` once per collapsed
parameter and misses the others. Its state dicts and checkpoints are then wrong (a resume
diverges); the step guard refuses it (E61) unless this module can restore the lists.

What is known: the positions ``D`` now occupies held, before, ``D`` itself and the missing
parameters, one each. Optimizers are built from ``model.parameters()`` or from groups each
listed in the model's order, so within a group the original parameters follow the model's
parameter order: a position between two known parameters held one whose place in that order lies
between theirs. The lists are restored only when exactly one assignment of the missing
parameters to the positions satisfies that (counted by a bounded search); otherwise nothing is
changed and E61 stands. Nothing is lost by restoring: the collapsed parameters hold no elements
on this rank, so no optimizer state of theirs existed here yet.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

__all__ = ["restore_collapsed"]

logger = logging.getLogger(__name__)

_SEARCH_LIMIT = 100_000  # backtracking steps before giving up (then E61 stands)


def _empty(p) -> bool:
    local = getattr(p, "_local_tensor", p)
    return local.numel() == 0


def restore_collapsed(optimizer, order: dict[int, int], params: dict[int, nn.Parameter]) -> Optional[int]:
    """Restore ``optimizer``'s lists if a collapse is provable; returns how many positions were
    restored (None: not restorable, nothing changed).

    ``order``: ``id(parameter) -> index`` in the model's parameter order (every unit parameter);
    ``params``: ``id -> parameter`` of those parameters."""
    counts: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            counts[id(p)] = counts.get(id(p), 0) + 1
    dups = [k for k, c in counts.items() if c > 1]
    if len(dups) != 1 or dups[0] not in order or not _empty(params[dups[0]]):
        return None
    dup = dups[0]
    candidates = sorted(
        [dup] + [k for k, p in params.items() if k not in counts and _empty(p)], key=lambda k: order[k]
    )
    # Every position of ``dup``, with the open interval of model-order indices its original lies in.
    slots = []  # (group index, position, low, high)
    for gi, group in enumerate(optimizer.param_groups):
        ps = group["params"]
        for i, p in enumerate(ps):
            if id(p) != dup:
                continue
            low = next((order[id(q)] for q in reversed(ps[:i]) if id(q) in order and id(q) != dup), -1)
            high = next((order[id(q)] for q in ps[i + 1:] if id(q) in order and id(q) != dup), len(order))
            slots.append((gi, i, low, high))
    if len(slots) > len(candidates):
        return None
    solutions: list[list[int]] = []
    steps = [0]

    def search(j: int, used: set, chosen: list[int]) -> None:
        if len(solutions) > 1 or steps[0] > _SEARCH_LIMIT:
            return
        if j == len(slots):
            solutions.append(list(chosen))
            return
        gi, _, low, high = slots[j]
        floor = low
        if j > 0 and slots[j - 1][0] == gi:  # within a group the originals follow the model's order
            floor = max(floor, order[chosen[-1]])
        for k in candidates:
            steps[0] += 1
            if k in used or not floor < order[k] < high:
                continue
            used.add(k)
            chosen.append(k)
            search(j + 1, used, chosen)
            chosen.pop()
            used.discard(k)

    search(0, set(), [])
    if len(solutions) != 1 or steps[0] > _SEARCH_LIMIT:
        return None
    for (gi, i, _, _), k in zip(slots, solutions[0]):
        optimizer.param_groups[gi]["params"][i] = params[k]
    logger.warning(
        "mfsdp2: %s held one parameter %d times: its lists were re-pointed by data_ptr(), which is 0 "
        "for every parameter this rank holds no rows of (Accelerate's prepare does this); restored "
        "from the model's parameter order", type(optimizer).__name__, len(slots))
    return len(slots)
