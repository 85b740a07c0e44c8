"""Whether a :class:`~mfsdp2.groups.param_group.ParameterGroup`'s gathered weights are stale: what
its host knows of writes to the main weights since the last gather, and what every gather
records.

Persistent weights (ZeRO-1/2, no_shard) are gathered once and reused until the main weights
change; ZeRO-3 gathers every time but must still re-cast. Host facts answer first -- an
optimizer step or an announced write (``changed``, the same on every rank) and a moved version
counter -- and, where the policy compares content, a fingerprint of the main shard catches writes
through ``.data`` that bump no counter. The decision is made at the root's forward from facts
every rank shares (:func:`mfsdp2.groups.weight_watch.agree_on_gathers`, whose docstring states
the policy), so every rank issues the same gathers.

``WeightChanges`` is a mixin over the group's state set up by ``ParameterGroup.__init__``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..memory.offload import copy_from_main
from .weight_watch import WatchMode, fingerprint, watch_mode

__all__ = ["WeightChanges"]


class WeightChanges:
    """Change detection of a group's main weights and the bookkeeping of each gather (mixed into
    :class:`~mfsdp2.groups.param_group.ParameterGroup`)."""

    def main_version(self) -> int:
        """Grows whenever anything writes the main weights in place (optimizer, loading)."""
        # DTensor ops bump the wrapper's counter, direct writes to a local bump the local's.
        # A plain loop: this runs at every gather and staleness check, over a few parameters.
        v = self.main_weight._version
        for dp in self.dist_params:
            v += dp._version + dp._local_tensor._version
        return v

    def refresh_model_shard(self) -> None:
        """Cast main -> model weights into a persistent buffer's local slice (persistent groups
        whose compute dtype differs). Done by every gather, the slice's only reader: the main
        weights are written by inits, loads and steps the group cannot all see, so a cast made
        earlier (at construction) could be stale by then."""
        if not self._needs_cast:
            return
        with torch.no_grad():
            # Offloaded (CUDA, pinned): on the copy-in stream; the shard's next reader waits on it.
            self.weights.shard_copy = copy_from_main(self.weights.shard, self.main_weight)
        self.casts += 1

    def mark_changed(self) -> None:
        """The main weights were (or may have been) written: re-cast and re-gather before the
        next use. Called on every rank (optimizer-step hook, ``mark_weights_changed``, loading)."""
        self.changed = True

    def changed_flag(self, one: torch.Tensor) -> torch.Tensor:
        """0-dim float on ``one``'s device: 1 when this rank sees a change since the last gather.
        Host facts (a step, an announced write, a moved version counter) answer without touching
        the device; otherwise the main shard's fingerprint is compared where the main weights
        live (no host read here)."""
        if self.host_changed() or self._gathered_fp is None:
            return one
        return (fingerprint(self.main_weight) != self._gathered_fp).any().to(device=one.device, dtype=one.dtype)

    @property
    def has_baseline(self) -> bool:
        """Whether the last gather took a fingerprint to compare with (the same on every rank:
        taken by the content check's groups whose :attr:`wants_baseline` held)."""
        return self._gathered_fp is not None

    @property
    def fingerprinted(self) -> bool:
        """Persistent weights whose content may be compared at a root forward (a write through
        ``.data`` bumps no counter). Not when the module computes with the main weights' own
        memory -- ``no_shard`` with equal main and compute dtypes: a shard group of one rank, the
        main weights *are* the full buffer -- where such a write is what the module reads anyway
        and nothing is re-cast or re-gathered; not after ``set_detect_data_writes(False)``.
        Whether it is compared or the group simply re-gathers is
        :func:`~mfsdp2.groups.weight_watch.watch_mode`'s decision."""
        return self.persistent and self.content_check and not self.computes_on_main

    def host_changed(self) -> bool:
        """A change this rank's host knows of: a step, an announced write, a moved version counter."""
        return self.changed or self.main_version() != self.gathered_version

    def begin_gather(self, fp: Optional[torch.Tensor] = None) -> None:
        """What every gather of the model weights starts with (its own or a bucket's). A gather
        happens because the main weights changed (persistent groups: ``stale``; ZeRO-3 casts
        inside the gather): re-cast the model shard every time. Deferring it to "the gather after
        the next" missed writes made after the last cast -- an init after ``to_empty`` -- and
        computed with the cast of uninitialised memory. ``fp``: the main shard's fingerprint,
        when the caller took it already (a bucket takes its members' in one batch)."""
        self.refresh_model_shard()
        self.gathered_version = self.main_version()
        self.changed = self.agreed_stale = False
        # Only the content check compares fingerprints: a group that re-gathers without a fact
        # takes none (three passes over the main shard per gather saved) and forgets the last
        # one, so a later switch to the check starts from "unknown" (a re-gather), never from a
        # fingerprint of older weights.
        self._gathered_fp = None
        # The root forward's prediction covers the one gather it planned: a later one (an
        # explicit ``unshard()`` between forwards, which consumes the step's fact) takes one.
        wants, self.wants_baseline = self.wants_baseline, True
        if self.persistent and wants and watch_mode(self) is WatchMode.CONTENT:
            self._gathered_fp = fp if fp is not None else fingerprint(self.main_weight)

    @property
    def stale(self) -> bool:
        """True when the weights changed after the last gather.

        Persistent weights: the root forward's decision (a re-gather without a fact, the agreed
        version counters and fingerprint, or the version counters alone: ``agree_on_gathers``) or
        a signal every rank gets (optimizer step, announced write).
        Local version counters are not consulted between root forwards: a rank holding no rows
        would decide differently and the ranks would issue different collectives. ZeRO-3 groups
        ask this only while gathered (kept across a step, or an in-flight ``unshard``). A group
        whose rows are still to come from a cross-unit bucket (:attr:`pending_gather`) counts as
        stale too: its next ``unshard`` must hand out the bucket's handle, not skip the wait. A
        group that ``computes_on_main`` (see :class:`ParameterGroup`) is never stale: its module
        reads the main weights."""
        if self.persistent:
            return ((self.agreed_stale or self.changed or self.pending_gather is not None)
                    and not self.computes_on_main)
        return self.changed or self.main_version() != self.gathered_version
