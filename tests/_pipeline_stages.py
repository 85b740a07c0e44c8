"""Pipeline stage classes for tests that run ``torch.distributed.pipelining`` schedules on gloo."""

from __future__ import annotations


def without_self_links(stage_cls):
    """``stage_cls`` without the link warm-up messages a stage sends to a neighbouring stage on
    its own rank.

    torch 2.11's schedules open the pipeline's links at the first step by one batched exchange
    with each neighbouring stage (``_get_init_p2p_neighbors_ops``), a neighbour on the same rank
    included (the V-shaped schedules place stages 1 and 2 on rank 1; a one-rank pipeline holds
    all stages). gloo cannot send to its own rank ("Pair is not connected"), so there such
    schedules fail on CPU with any stage module, FSDP2's and plain ones too, before a stage runs.
    Those messages open no link (nothing goes over the wire between two stages of one rank), so
    dropping them changes nothing else; torch 2.13 warms up through a vote that never calls this
    method, so there the class behaves exactly as ``stage_cls``."""

    class Stage(stage_cls):
        def _get_init_p2p_neighbors_ops(self):
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    Stage.__name__ = Stage.__qualname__ = stage_cls.__name__
    return Stage
