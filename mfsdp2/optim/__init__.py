"""Optimizers that step mfsdp2's flat shards: :class:`AdamW` (torch's AdamW, same signature,
state format and results; one native call per step on the host, one fused launch per group on
an accelerator; optionally bfloat16 moments, :mod:`mfsdp2.optim.bf16_states`). See
``docs/optim.md``."""

from .adamw import AdamW

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint",
                               "frontend", "integrations")

__all__ = ["AdamW"]
