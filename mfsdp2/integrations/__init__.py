"""Other torch features mfsdp2 plugs into: pipelining, tensor parallel, gradient clipping, and
the bridge to older torch versions.

Owns ``compat`` (what differs between the supported torch versions; imports nothing of mfsdp2,
so every folder may use it), ``tensor_parallel`` (a TP-sharded parameter under ``fully_shard``;
imports only ``dtensors.placement``), ``clip_grad`` (``clip_grad_norm_`` over the flat
gradients; imports ``comm.communicator`` and ``memory.param_group``) and ``pipelining`` (a
``PipelineStage`` that drives mfsdp2 units; imports ``frontend.module`` and ``runtime.hooks``).
"""
