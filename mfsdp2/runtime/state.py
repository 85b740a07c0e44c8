"""Per-unit state and the per-model root context, with explicit state enums.

Every ``fully_shard`` call creates one :class:`FSDPState` (a *unit*). At the first forward the unit
whose forward runs outermost becomes the **root**: it creates a :class:`RootContext` shared by every
unit below it (one allocator, one communicator per process group, the recorded execution order
and the backward bookkeeping), so no unit needs to know its neighbours.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..memory.allocator import BucketAllocator
from ..memory.trace_pool import make_allocator
from ..comm.communicator import Communicator
from .fsdp2_state import FSDP2StateNames
from ..groups.gather_buckets import GatherBuckets
from ..groups.grad_buckets import GradientBuckets
from ..precision.mixed_precision import MixedPrecisionPolicy

if TYPE_CHECKING:
    from ..groups.param_group import ParameterGroup

__all__ = ["ShardState", "TrainingState", "FSDPState", "RootContext", "unit_state"]

logger = logging.getLogger(__name__)


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only the shards exist
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited
    UNSHARDED = "unsharded"  # gathered and registered on the module
    PARTIAL = "partial"  # reshard_after_forward=<int>: holds the shards its rank block needs


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"  # unsharded for (or running) its backward
    POST_BACKWARD = "post_backward"  # gradients handed to reduce-scatter


_MISSING = object()


class _Planned:
    """An attribute of :class:`FSDPState` a unit's step plan decides from
    (:mod:`mfsdp2.runtime.step_plan`): a write that changes its value counts in the unit's
    ``flags_version``, so the plan is rebuilt at its next use.

    Why a descriptor with ``__set__`` only: reads find the value in the instance's ``__dict__``
    at the speed of a plain attribute (the hooks read these often); only writes, rare, pay."""

    __slots__ = ("name",)

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __set__(self, obj, value) -> None:
        d = obj.__dict__
        old = d.get(self.name, _MISSING)
        d[self.name] = value
        if old is not value and (type(old) is not type(value) or old != value):
            d["flags_version"] = d.get("flags_version", 0) + 1


class FSDPState(FSDP2StateNames):
    """Everything ``fully_shard`` attached to one module (``fully_shard.state(module)``; FSDP2's
    private names for it come from :class:`~mfsdp2.runtime.fsdp2_state.FSDP2StateNames`).

    The attributes declared :class:`_Planned` below are those a unit's step plan is built from;
    ``flags_version`` counts the changes to them."""

    name = _Planned()
    groups = _Planned()
    mp = _Planned()
    reshard_after_forward = _Planned()
    reshard_after_backward = _Planned()
    requires_gradient_sync = _Planned()
    unsettled = _Planned()
    subclass = _Planned()

    def __init__(
        self,
        module: nn.Module,
        name: str,
        mesh: DeviceMesh,
        comm: Communicator,
        groups: "list[ParameterGroup]",
        mp: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        allocator_spec,
    ):
        self.flags_version = 0
        self.plan = None  # step_plan.UnitPlan, built at the first use after a change
        self.output_hook = None  # the pre-backward hook on the outputs, made once (hooks.post_forward)
        self.module = module
        self.name = name
        self.mesh = mesh
        self.comm = comm
        self.groups = groups
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_forward_given = True  # False: fully_shard got None (the root then keeps them)
        self.allocator_spec = allocator_spec
        self.ctx: Optional[RootContext] = None
        self.shard_state = ShardState.SHARDED
        self.training_state = TrainingState.IDLE
        self.pending_unshard: list = []
        # Per-iteration flags, reset by the root's final backward callback.
        self.forward_with_grad = False
        self.post_backward_done = False
        self.expect_backward = False  # a forward of this iteration will run a backward (prefetch it)
        # Learned across iterations: this unit's backward arrives as a recompute of a forward that
        # ran under no_grad (reentrant activation checkpointing around the whole unit).
        self.backward_via_recompute = False
        # User controls (FSDP2 names).
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.is_last_backward = True
        self.forward_prefetch: Optional[list[FSDPState]] = None  # explicit overrides of the schedule
        self.backward_prefetch: Optional[list[FSDPState]] = None
        self.post_forward_comm = None  # block communicator for reshard_after_forward=<int>
        # fully_shard([a, b, ...]): every module of the unit (``module`` is the first). The unit is
        # gathered once for all of them and reshards after the last one's forward of the pass.
        self.modules: list[nn.Module] = [module]
        self.forward_to_run: set[int] = set()  # ids of the modules whose forward is still to come
        self.forward_pass = None  # backward._ForwardPass of the latest grad-enabled forward pass
        self.open_passes = 0  # grad-enabled forward passes of this iteration whose backward is still to run
        self.unshard_in_backward = True  # False: backward needs none of the weights (set_unshard_in_backward)
        # An input-only backward ran through the unit (resharded after forward, kept gathered,
        # no sync) and no backward computed its weight gradients since: the step guard refuses
        # the optimizer step (E52, backward._note_input_only_backward).
        self.weights_missed = False
        # Reduction inputs alive at once, this unit's included (set_reduce_scatter_max_input_buffers).
        self.max_reduce_in_flight = 1
        # Some group holds pending parameter values (mfsdp2.runtime.param_adoption): settled or refused
        # before the next gather.
        self.unsettled = False
        # set_reduce_scatter_unused_params(True): agree on gradient presence (mfsdp2.runtime.grad_presence)
        self.reduce_unused_params = False
        # (pre-forward, post-forward) hook handles of each module of the unit (fully_shard), and
        # whether a tool replaced them with its own (FSDP2's handle setters).
        self.forward_hook_handles: list = []
        self.hooks_taken_over = False
        # FSDP2's group object for this unit, made at the first read of _fsdp_param_group(s).
        self.fsdp2_view = None
        # Parameters with FSDP2's all-gather extension (mfsdp2.groups.subclass_gather.SubclassUnit), or None.
        self.subclass = None
        # A quiet pass (mfsdp2.runtime.quiet_units): the root ran this unit's forward-hook work;
        # its trainable parameters' accumulator hooks count down from quiet_count to its post-backward.
        self.quiet_pass = False
        self.quiet_count = 0
        self.quiet_left = 0
        self.quiet_hooks = None  # the (pre, post) forward hook functions while detached
        # Kept gathered after a backward that recorded a graph reading its weights (graph_hold).
        self.held_for_graph = False

    def __repr__(self) -> str:
        return f"FSDPState({self.name!r}, {self.shard_state.value}, {self.training_state.value})"

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self


def unit_state(module: nn.Module) -> Optional[FSDPState]:
    """The :class:`FSDPState` ``fully_shard`` attached to ``module``; None when it is not a unit.

    ``fully_shard`` sets it together with the class swap to ``FSDPModule``, so this is the same
    test as ``isinstance(module, FSDPModule)`` for files below ``module.py`` (hooks, checkpoints),
    which must not import it."""
    return module.__dict__.get("_mfsdp2_state")


class RootContext:
    """State shared by all units under one root."""

    def __init__(self, root: FSDPState, states: list[FSDPState], allocator: BucketAllocator, schedule):
        self.root = root
        self.states = states  # pre-order (root first), i.e. module registration order
        self.allocator = allocator
        # A schedule.Schedule, made by the caller (hooks.lazy_init): schedule.py reads FSDPState,
        # so this module must not import it.
        self.schedule = schedule
        self.callback_queued = False
        # (unit, tensor): a unit's one output whose pre-backward the next unit's input function
        # may run instead of a hook on it (runtime.output_hooks), until the next runtime entry.
        self.pending_output = None
        self.presence_checks: list = []  # CUDA gradient-presence checks still in flight (grad_presence)
        self.reduce_queue: list[FSDPState] = []  # units with a reduce-scatter in flight, oldest first
        self.allreduce_queue: list[FSDPState] = []  # HSDP: units whose all-reduce across replicas is in flight
        # Full-gradient strategies' all-reduces, bucketed across units (grad_buckets.py); their
        # units never enter reduce_queue for those groups.
        self.buckets = GradientBuckets(allocator, root.name)
        # All-gathers bucketed across units: persistent weights at each root forward, small ZeRO-3
        # units (when a cap is set) at the root forward and at each backward (gather_buckets.py).
        self.gathers = GatherBuckets(allocator, root.name)
        self.step = 0
        # set_post_optim_event: the next root forward makes the current stream wait on it first.
        self.post_optim_event = None
        # Quiet passes (runtime.quiet_units): allowed (off only to measure the hooked pass), the
        # pass running is one, and the units whose forward hooks are detached now.
        self.quiet_allowed = True
        self.quiet = False
        self.quiet_detached: list[FSDPState] = []
        self.quiet_guard = None  # the root's always-call forward hook that attaches them again
        self.graph_held = False  # some unit is held gathered for a graph recorded in backward (graph_hold)

    @classmethod
    def create(cls, root: FSDPState, states: list[FSDPState], schedule) -> "RootContext":
        ctx = cls(root, states, make_allocator(root.allocator_spec), schedule)
        for s in states:
            s.ctx = ctx
        logger.debug("mfsdp2: root %s owns %d units", root.name, len(states))
        return ctx
