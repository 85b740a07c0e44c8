"""The step lifecycle: what runs around every forward, backward and optimizer step.

Owns the forward / backward hooks (``hooks``) and the end of backward driven from outside
autograd (``external_backward``: a pipeline schedule's REDUCE_GRAD), the recorded module order and the prefetch
schedule built from it (``schedule``), the per-unit and per-step state (``state``), the checks
before an optimizer step (``step_guard``), the agreement on which gradients exist
(``grad_presence``), user diagnostics (``diagnostics``) and profiler ranges (``profiling``).

Imports: ``memory``, ``comm``, ``precision``, ``dtensors`` and ``integrations.compat`` below it,
and from ``frontend`` only ``fsdp2_state``, ``param_adoption``, ``shared_params`` and
``structures`` (never ``fully_shard`` or ``module``, which import this folder). ``profiling``
imports nothing of mfsdp2, so every folder may use it.
"""
