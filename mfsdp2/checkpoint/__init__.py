"""Checkpoint support of mfsdp2: state dicts and checkpoints; the public entry point is
:mod:`mfsdp2.checkpoint.state_dict`.

* ``state_dict`` — DCP / DSD helpers over mfsdp2 and torch FSDP2 models (the public functions);
* ``serialization`` — ``torch.save`` / ``torch.load`` of state dicts holding our DTensors;
* ``_common`` — global-coordinate helpers (rows of a placement, write-nothing tags, unit walk,
  gather/broadcast of nested state dicts in one order on every rank);
* ``model`` — the state-dict hooks ``fully_shard`` registers (save from / load into main weights);
* ``optim`` — optimizer states around torch's DSD (relabel by parameter rows, placeholders);
* ``fused`` — split/join fused parameters (SwiGLU ``fc1``) in sharded or full state dicts;
* ``hf`` — Hugging Face safetensors: per-rank row reads on import, gathered export.

``frontend`` imports this folder to register the state-dict hooks on each unit.
"""

MAY_IMPORT: tuple[str, ...] = ("base", "comm", "dtensors", "memory", "precision", "groups", "runtime")
