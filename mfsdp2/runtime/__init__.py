"""The step lifecycle: what runs around every forward, backward and optimizer step.

Owns the forward / backward hooks (``hooks``, ``backward``; which of them a unit's outputs get:
``output_hooks``; the passes that run the units with none: ``quiet_units``) and the end of backward
driven from outside autograd (``external_backward``: a pipeline schedule's REDUCE_GRAD), the
gathered weights a graph recorded in backward still reads (``graph_hold``), the recorded module
order and the prefetch schedule built from it (``schedule``), each unit's steady-state decisions
(``step_plan``), the per-unit and per-step state (``state``) with FSDP2's names for it
(``fsdp2_state``), the checks before an optimizer step (``step_guard``), the agreement on which
gradients exist (``grad_presence``), parameters shared between units (``shared_params``), values
that reach a unit outside its shards (``param_adoption``) and user diagnostics (``diagnostics``).
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups")
