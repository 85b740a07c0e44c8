"""Checkpoint support of mfsdp2; the public entry point is :mod:`mfsdp2.state_dict`.

* ``_common`` — global-coordinate helpers (rows of a placement, write-nothing tags, unit walk,
  gather/broadcast of nested state dicts in one order on every rank);
* ``model`` — the state-dict hooks ``fully_shard`` registers (save from / load into main weights);
* ``optim`` — optimizer states around torch's DSD (relabel by parameter rows, placeholders);
* ``fused`` — split/join fused parameters (SwiGLU ``fc1``) in sharded or full state dicts;
* ``hf`` — Hugging Face safetensors: per-rank row reads on import, gathered export.
"""
