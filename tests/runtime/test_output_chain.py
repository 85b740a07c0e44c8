"""A unit whose one output is the next unit's input, and whose backward gathers nothing, has its
pre-backward run by that next unit's input function instead of a hook on the output
(:mod:`mfsdp2.runtime.output_hooks`).

Each case trains four ``Linear`` units under a root, in float64 at world size 2 (and ZeRO-3 at
world size 1, whose one-rank groups keep their weights), three steps with SGD, and compares every
step's gradients with the unsharded float64 model's on the same batches:

* ``chain`` (each unit feeds the next): the persistent strategies hook only the output the root
  returns (the last unit's, settled at the root's post-forward, and the root's own: 2 hooks per
  step), ZeRO-3 at two ranks hooks every unit's (it gathers in backward); every unit's
  pre-backward still runs, in backward order (the event log);
* ``dropped``: the unit that takes the first unit's output has its own output dropped from the
  loss, so the input function carrying the first unit's pre-backward never runs, while the
  first unit's backward does (through another consumer): its gradients are still right, and at
  ZeRO-3 over two ranks (where skipping that pre-backward would leave its weights freed) it is
  hooked;
* ``branch``: one output feeds two units that both reach the loss;
* ``inplace``: the output is changed in place before the next unit takes it;
* ``side``: the loss is taken from the first unit's output (which the next unit took), not from
  the root's: no hooked output is reached, and the first input function to run queues the root's
  final callback, which reduces the gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from mfsdp2 import fully_shard
from mfsdp2.base.profiling import event_log

from .._dist import run_ranks
from ..models import F64, REL_F64, assert_close_rel

GB, D = 8, 12


class _Net(nn.Module):
    def __init__(self, graph: str):
        super().__init__()
        self.graph = graph
        self.pre = nn.Linear(D, D)  # the root's: unit a's backward computes an input gradient (needs its weight)
        self.a, self.b, self.c, self.d = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        h = self.a(self.pre(x))
        if self.graph == "chain":
            return self.d(self.c(self.b(h)))
        if self.graph == "dropped":
            self.b(h)  # takes the output first; its own output never reaches the loss
            return self.d(self.c(h))
        if self.graph == "branch":
            return self.d(self.b(h) + self.c(h))
        if self.graph == "side":
            self.side = h  # the loss is taken here: the backward starts at an output no hook is on
            return self.d(self.c(self.b(h)))
        h.mul_(2.0)  # inplace
        return self.d(self.c(self.b(h)))


def _run_all(rank: int, ws: int, strategy: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    return {graph: _run(rank, ws, mesh, strategy, graph) for graph in GRAPHS}


def _run(rank: int, ws: int, mesh, strategy: str, graph: str) -> dict:
    torch.manual_seed(0)
    ref = _Net(graph).to(F64)
    model = _Net(graph).to(F64)
    model.load_state_dict(ref.state_dict())
    for m in (model.a, model.b, model.c, model.d):
        fully_shard(m, mesh=mesh, sharding_strategy=strategy)
    fully_shard(model, mesh=mesh, sharding_strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    hooks, real = [0], torch.Tensor.register_hook

    def counting(self, hook):
        hooks[0] += 1
        return real(self, hook)

    out = {"errors": [], "hooks": [], "backward_begins": []}
    event_log.enabled = True
    n = GB // ws
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(GB, D, generator=g, dtype=F64)
        torch.Tensor.register_hook = counting
        hooks[0] = 0
        try:
            y = model(x[rank * n : (rank + 1) * n])
            loss = (model.side if graph == "side" else y).square().sum().mul(1.0 / n)  # mean over ranks
        finally:
            torch.Tensor.register_hook = real
        out["hooks"].append(hooks[0])
        event_log.clear()
        loss.backward()
        out["backward_begins"].append([u for kind, u in event_log.events if kind == "backward_begin"])
        y = ref(x)
        (ref.side if graph == "side" else y).square().sum().mul(1.0 / GB).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:
                if p.grad is not None:
                    out["errors"].append(f"step {step} {name}: a gradient where the reference has none")
                continue
            got = p.grad.full_tensor() if p.grad is not None else torch.zeros_like(q)
            try:
                assert_close_rel(got, q.grad, f"step {step} {name}", REL_F64)
            except AssertionError as e:
                out["errors"].append(str(e))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return out


GRAPHS = ("chain", "dropped", "branch", "inplace", "side")
CASES = [(2, s) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")] + [(1, "optim_grads_params")]


@pytest.mark.parametrize("ws,strategy", CASES)
def test_chained_pre_backward_matches_the_unsharded_model(ws, strategy):
    outs = run_ranks(_run_all, ws, strategy)  # one launch per case: every graph in it
    gathers_in_backward = strategy == "optim_grads_params" and ws > 1
    for by_graph in outs:
        for graph, out in by_graph.items():
            assert not out["errors"], (graph, out["errors"])
        chain, dropped = by_graph["chain"], by_graph["dropped"]
        # Steady steps: 2 hooks where the units chain, one per unit and the root's otherwise.
        assert chain["hooks"][1:] == [5 if gathers_in_backward else 2] * 2, chain["hooks"]
        # Every unit's pre-backward ran, in backward order, hooked or chained.
        assert chain["backward_begins"] == [["d", "root", "c", "b", "a"]] * 3, chain["backward_begins"]
        if gathers_in_backward:
            assert dropped["hooks"] == [5] * 3, dropped["hooks"]  # every unit and the root: nothing chained
