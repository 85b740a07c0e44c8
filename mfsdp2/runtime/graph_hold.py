"""Gathered weights that a graph recorded in backward still reads: kept until a backward that
records no graph, or the root's next forward.

Why: a backward with ``create_graph=True`` (a gradient penalty:
``gx, = torch.autograd.grad(loss, x, create_graph=True)``, then ``(loss + gx.square().sum()).backward()``;
R1 regularisation; Hessian-vector products) records a graph of its own, whose nodes save the
unit's gathered parameters -- views of the unit's flat buffer. The unit's post-backward would
free that buffer (its storage emptied in place, to be refilled by the next gather). The next
backward then runs those nodes *first*: they are newer than the forward's nodes, and autograd's
engine runs the newest ready node first, so they run before the unit's pre-backward has gathered
again, and read freed memory. The process dies with SIGSEGV (torch FSDP2's does too).

What this module does instead:

* in a backward that records a graph (grad mode is on inside it exactly then), a unit whose
  reshard would free memory stays gathered (:func:`hold`): its post-backward and the root's
  final callback skip the reshard. Persistent weights (no_shard, ZeRO-1/2) free nothing and
  are resharded as usual;
* a later backward that records no graph -- the one through the penalty -- finds the unit
  gathered (its pre-backward has nothing to gather) and reshards it at its end, as every unit;
* what is still held when the root's next forward begins (no such backward came, e.g. the
  optimizer stepped after the ``create_graph`` pass) is resharded there, so that forward
  gathers the weights anew (``hooks._begin_step``);
* whenever a held unit reshards, its unsharded parameters' version counters are bumped first
  (:func:`unhold`): a graph that still holds them (a backward through a graph recorded before
  the next forward, or one retained past its backward) then raises autograd's "modified by an
  inplace operation" error instead of reading freed memory. (The plain groups' parameters:
  a tensor-subclass parameter's wrapper, torchao's, is held and released alike but not marked.)

Between the ``create_graph`` backward and the one after it (or the next forward), the module of
a held unit shows its DTensor parameters, as after any backward (``model.parameters()`` for an
optimizer built then, clipping, the state dict), while the gathered memory stays. Every unit
that backward reached is held, so the model's full weights are all resident until the next
backward ends (as with ``reshard_after_forward=False`` everywhere).
"""

from __future__ import annotations

import torch

from .state import FSDPState, ShardState

__all__ = ["hold", "register_held", "unhold"]


def _frees_memory(state: FSDPState) -> bool:
    """Whether resharding the unit gives its gathered weights' memory back (ZeRO-3, subclass
    parameters), rather than only swapping the registered parameters (persistent weights)."""
    return state.subclass is not None or any(not g.persistent for g in state.groups)


def hold(state: FSDPState) -> bool:
    """In autograd's backward, where the unit would reshard: keep it gathered if the running backward
    records a graph and resharding would free the weights that graph saved; returns whether it
    is held (the caller then skips the reshard). Callers test ``torch.is_grad_enabled()``
    first: off in every other backward, so the usual post-backward pays one call less.

    Not held: outside autograd's engine (a pipeline schedule ending the backward itself, where
    grad mode is on but nothing is recorded), and under ``torch.func`` transforms, whose
    ``grad`` records a graph in every backward and uses it before returning (holding there would
    keep every unit's full weights resident after each ``torch.func.grad`` call, until the next
    forward)."""
    if (not torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1
            or torch._C._are_functorch_transforms_active()
            or state.shard_state is ShardState.SHARDED or not _frees_memory(state)):
        return False
    state.held_for_graph = True
    state.ctx.graph_held = True
    # The module shows its DTensor parameters again (an optimizer or a clipping built now takes
    # them), while the gathered memory stays for the graph; the unit's next use registers the
    # unsharded ones again (register_held).
    _register(state, unsharded=False)
    return True


def register_held(state: FSDPState) -> None:
    """A held unit is used again (a pre-forward or pre-backward: an activation-checkpoint
    recompute, a forward before the next backward): its gathered parameters, still current, are
    the module's again."""
    _register(state, unsharded=True)


def _register(state: FSDPState, unsharded: bool) -> None:
    for g in state.groups:
        g.register(unsharded=unsharded)
    if state.subclass is not None:
        state.subclass.register(unsharded=unsharded)


def unhold(state: FSDPState) -> None:
    """When a held unit reshards (a backward that records no graph ended, or the root's next
    forward released it): mark its unsharded parameters as written, so that a graph still
    holding them raises autograd's error instead of reading the memory the reshard frees."""
    state.held_for_graph = False
    for g in state.groups:
        for p in g.unsharded_params:
            torch.autograd.graph.increment_version(p)
