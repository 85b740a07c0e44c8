"""Example scripts for mfsdp2: a 2-rank CPU demo and a trainer written for FSDP2 that runs on
either runtime. The top layer: it imports mfsdp2 as a user does (``from mfsdp2 import ...``)."""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime", "checkpoint",
                               "frontend", "integrations", "optim", "models", "estimate", "mfsdp2")
