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

Between the ``create_graph`` backward and the one after it, a held unit is gathered as after a
forward with ``reshard_after_forward=False``: plain parameters are registered and the state dict
is its DTensors. Every unit that backward reached is held, so the model's full weights are all
resident until the next backward ends (as with ``reshard_after_forward=False`` everywhere).
"""

from __future__ import annotations

import torch

from .state import FSDPState, ShardState

__all__ = ["hold", "unhold"]


def _frees_memory(state: FSDPState) -> bool:
    """Whether resharding the unit gives its gathered weights' memory back (ZeRO-3, subclass
    parameters), rather than only swapping the registered parameters (persistent weights)."""
    return state.subclass is not None or any(not g.persistent for g in state.groups)


def hold(state: FSDPState) -> bool:
    """In autograd's backward, where the unit would reshard: keep it gathered if the running backward
    records a graph and resharding would free the weights that graph saved; returns whether it
    is held (the caller then skips the reshard). Callers test ``torch.is_grad_enabled()``
    first: off in every other backward, so the usual post-backward pays one call less."""
    if (not torch.is_grad_enabled() or torch._C._current_graph_task_id() == -1
            or state.shard_state is ShardState.SHARDED or not _frees_memory(state)):
        return False  # (outside autograd's engine: a pipeline schedule ending the backward itself)
    state.held_for_graph = True
    state.ctx.graph_held = True
    return True


def unhold(state: FSDPState) -> None:
    """When a held unit reshards (a backward that records no graph ended, or the root's next
    forward released it): mark its unsharded parameters as written, so that a graph still
    holding them raises autograd's error instead of reading the memory the reshard frees."""
    state.held_for_graph = False
    for g in state.groups:
        for p in g.unsharded_params:
            torch.autograd.graph.increment_version(p)
