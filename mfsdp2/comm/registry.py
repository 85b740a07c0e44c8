"""One communicator per (process group, device), shared by every unit that shards over it.

Why shared: a communicator owns the group's side streams, its gloo twin for host metadata and
its sub-groups (``dist.new_group`` is collective), so two units over one mesh must use one
object. Why not keyed by ``id(group)`` alone: after ``destroy_process_group()`` and a new
``init_process_group()`` in the same process (test harnesses, elastic restarts, notebooks) the
old communicators are bound to destroyed groups. Each entry remembers the default group it was
made under; when ``dist.group.WORLD`` is another object (or None) the whole cache is dropped
before the lookup, so a communicator of a destroyed group is never handed out, and the old
groups it held can be freed.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from .communicator import Communicator

__all__ = ["communicator_for", "clear_communicators"]

logger = logging.getLogger(__name__)

_cache: dict[tuple[int, str], Communicator] = {}
_world: list = [None]  # the default group the cached communicators were made under


def clear_communicators() -> None:
    """Forget every cached communicator (the next ``fully_shard`` makes new ones)."""
    _cache.clear()
    _world[0] = None


def communicator_for(group: Optional[dist.ProcessGroup], device: torch.device) -> Communicator:
    """The communicator of ``group`` on ``device`` (``None``: this rank alone), made once per
    default process group."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if _cache and _world[0] is not world:
        logger.info("mfsdp2: the default process group changed; %d cached communicators dropped", len(_cache))
        clear_communicators()
    _world[0] = world
    key = (id(group), str(device))
    comm = _cache.get(key)
    if comm is None or comm.group is not group:
        comm = _cache[key] = Communicator(group, device)
    return comm
