"""mfsdp2 units as torch's ``FSDPModule``: what code written for FSDP2 tests with ``isinstance``.

Trainers and torch's own tools recognise an FSDP2 unit by
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` and then call its public methods:
torchtitan sets the gradient divide factor to 1.0 that way (it divides the loss by the global
token count itself) and keeps a chunked loss's lm_head gathered; Accelerate and Lightning decide
that a model is already sharded and which state-dict path to take; torch's pipeline stages and
schedules drive the units' gradient sync and their explicit unshard / reshard. A user who swaps
only ``fully_shard`` for mfsdp2's keeps those checks. If mfsdp2 units failed them, the trainer would
silently take its non-FSDP path. In torchtitan that keeps the default averaging over the ranks,
so gradients come out world-size times too small and nothing reports it.

So mfsdp2's ``FSDPModule`` subclasses torch's. That is sound only if no call on an mfsdp2 unit
reaches torch's implementation, which reads FSDP2's private state. This file keeps it so:

* :func:`check_overrides` runs when the class is defined: every function torch's class defines
  (its public methods, ``_get_fsdp_state``, ``_apply``, ...) must be defined again below torch's
  class in mfsdp2's MRO. A method a newer torch adds is replaced by one that raises
  :class:`UnsupportedFSDP2MethodError` naming it; it does not fall through to FSDP2's code.
* :func:`register_torch_state` makes torch's own ``fully_shard.state(unit)`` (its ``@contract``
  lookup, used by torch's pipeline stages at the REDUCE_GRAD action) return the unit's mfsdp2
  state, which answers FSDP2's names with mfsdp2's meaning
  (:mod:`mfsdp2.runtime.fsdp2_state`). Only the state slot is filled, not the composable
  registry, so torch's ``fully_shard`` and DSD do not treat the module as one of their own.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Optional

import torch.nn as nn

logger = logging.getLogger(__name__)

try:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2 (mfsdp2 needs torch >= 2.11, which has it)
    TorchFSDPModule = None

__all__ = ["TorchFSDPModule", "UnsupportedFSDP2MethodError", "check_overrides", "register_torch_state", "torch_bases"]


class UnsupportedFSDP2MethodError(RuntimeError):
    """A method of torch's ``FSDPModule`` (from a torch newer than this mfsdp2) called on an
    mfsdp2 unit, which has no mfsdp2 version of it."""


def torch_bases() -> tuple:
    """The bases of mfsdp2's ``FSDPModule``: torch's ``FSDPModule`` where torch has it."""
    return (TorchFSDPModule,) if TorchFSDPModule is not None else ()


def _functions(base: type) -> list[str]:
    """The names of the functions (methods, static / class methods, properties) ``base`` defines."""
    skip = {"__dict__", "__weakref__", "__module__", "__doc__", "__init_subclass__"}
    return [n for n, v in vars(base).items()
            if n not in skip and (callable(v) or isinstance(v, (staticmethod, classmethod, property)))]


def _refusal(name: str):
    def refuse(self, *args, **kwargs):
        raise UnsupportedFSDP2MethodError(
            f"mfsdp2: FSDPModule.{name} is torch FSDP2 API that this mfsdp2 version does not "
            f"support (called on {type(self).__name__}); it would act on FSDP2's internal "
            "state, which mfsdp2 units do not have. Use torch.distributed.fsdp.fully_shard for "
            "this module, or an mfsdp2 version that supports it."
        )

    refuse.__name__ = name
    return refuse


def check_overrides(cls: type, base: Optional[type] = None) -> list[str]:
    """Install a refusing method on ``cls`` for each function of ``base`` (torch's ``FSDPModule``)
    that ``cls`` (or a class between it and ``base``) does not define; returns their names.

    Why: mfsdp2's class inherits torch's, so a method mfsdp2 lacks would otherwise run torch's
    code on an object without FSDP2's state and fail obscurely or, worse, set an attribute on a
    view that nothing reads."""
    base = TorchFSDPModule if base is None else base
    if base is None:
        return []
    mro = cls.__mro__
    below = mro[: mro.index(base)]
    missing = [n for n in _functions(base) if not any(n in vars(c) for c in below)]
    for name in missing:
        setattr(cls, name, _refusal(name))
    if missing:
        logger.debug("mfsdp2: torch FSDPModule methods without an mfsdp2 version: %s", missing)
    return missing


def _torch_state_slot() -> Optional[tuple[str, Any]]:
    """``(state key, torch's fully_shard function)``: where torch's ``fully_shard.state`` looks.

    torch's ``@contract`` keeps each module's states in ``module.__dict__[STATE_KEY]`` keyed by
    the decorated function, which its ``state`` accessor holds in its closure. ``None`` where this
    torch lays it out otherwise (torch's pipeline stages then cannot find the state)."""
    try:  # the module (the package re-exports the decorator under the module's name)
        _contract = importlib.import_module("torch.distributed._composable.contract")
        from torch.distributed.fsdp import fully_shard as _torch_fully_shard
    except ImportError:  # pragma: no cover
        return None
    getter = getattr(_torch_fully_shard, "state", None)
    code = getattr(getter, "__code__", None)
    if code is None or getter.__closure__ is None or "func" not in code.co_freevars:
        return None
    func = getter.__closure__[code.co_freevars.index("func")].cell_contents
    key = getattr(_contract, "STATE_KEY", None)
    return None if key is None else (key, func)


_SLOT = _torch_state_slot()


def register_torch_state(module: nn.Module, state: Any) -> bool:
    """Make torch's ``fully_shard.state(module)`` return ``state``, and enter the module in
    torch's composable-API registry as ``fully_shard`` -- where ``replicate()`` (torch's
    composable DDP) and torch's other checks look for FSDP-managed modules, so that a
    ``replicate()`` of a parent leaves the unit's parameters to the unit, as with FSDP2. False
    where this torch's layout is unknown (see :func:`_torch_state_slot`)."""
    if _SLOT is None:
        return False
    key, func = _SLOT
    slot = module.__dict__.setdefault(key, {})
    if not isinstance(slot, dict):
        return False
    slot[func] = state
    registry_key = getattr(_contract_module(), "REGISTRY_KEY", None)
    item = getattr(_contract_module(), "RegistryItem", None)
    if registry_key is not None and item is not None:
        registry = module.__dict__.setdefault(registry_key, {})
        if isinstance(registry, dict):
            registry.setdefault("fully_shard", item())
    return True


def _contract_module():
    return importlib.import_module("torch.distributed._composable.contract")
