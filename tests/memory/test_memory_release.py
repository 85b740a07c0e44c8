"""Memory only backward uses is held only while it is used, and what is free goes back to torch.

Mechanisms (``mfsdp2/memory/allocator.py`` "What is held when", ``mfsdp2/groups/grad_views.py``):

* main gradients (and all-reduce buckets whose slices are main gradients) go back to torch when
  released at the next forward -- not into a cache of mfsdp2's, where the forward's activations
  could never use them;
* a freed block goes back to torch at once unless torch cannot hold it cheaply (on the CPU,
  blocks glibc maps afresh: 32 MiB and more), and those are cached only within a phase of the
  step: at the end of the training forward and of backward the allocator gives back everything
  idle but the blocks the next phase asks for before it frees one;
* the gradient DTensors cached across steps do not keep an old main gradient alive: re-pointed,
  not rebuilt; one the user still holds keeps its own values;
* the trace pool plans one pool per phase, outside of which it holds nothing.

With torch's CPU allocator (malloc) a reuse by activations cannot be observed directly; what is
checked is that mfsdp2 holds nothing idle at the moments activations are allocated (its own
accounting: ``idle_bytes``), that released blocks are really freed (weak references die), and,
with torch's memory tracker, that the step's peak equals the schedule's bound
(tests/memory/test_memory_peak.py).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import mfsdp2.memory.allocator as A
import mfsdp2.optim
from mfsdp2 import fully_shard
from mfsdp2.base import compat
from mfsdp2.memory.allocator import CachingAllocator

from .._dist import run_ranks

D, H, B = 32, 64, 4


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(B))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


# -- the caching allocator's rules, driven directly ---------------------------------------------
def _req(a, key, n, device="cpu"):
    return a.allocate(key, n, torch.float32, device)


@pytest.mark.parametrize("fresh", [False, True])
def test_main_gradients_follow_the_big_block_rule_and_non_cpu_blocks_go_back(monkeypatch, fresh):
    """Main gradients and buckets, released at each forward and asked for again in backward: where
    malloc keeps such a block (below ``MAP_FRESH_BYTES``) every release goes back to torch and
    every request obtains one; where glibc would map it afresh (``fresh``: here all) the cache keeps
    it from the forward's release to the backward's request, as it keeps any big block the step
    asks for again (handing it back re-faulted a no_shard model's gradients every step). A device
    with a caching allocator of its own (meta stands in for CUDA here) is never cached."""
    if fresh:
        monkeypatch.setattr(A, "MAP_FRESH_BYTES", 0)
    a = CachingAllocator()
    keys = (("main_grad", "u", 0), ("grad_bucket", "x", 0))
    idle_after_release = []
    for step in range(4):
        a.mark_step()
        if step:
            for key in keys:
                a.free(key)  # the root's forward releases last step's main gradients
        idle_after_release.append(a.idle_bytes())
        _req(a, ("weight", "u", 1), 1 << 20, "meta")
        a.free(("weight", "u", 1))
        a.release_idle("backward")
        for key in keys:
            _req(a, key, 256)  # the backward writes them again
        assert a.idle_bytes() == 0, (step, key)
        a.release_idle("forward")
    if fresh:  # step 0 obtains them (and records what backward opens with); then the kept ones serve
        assert idle_after_release == [0, 2048, 2048, 2048], idle_after_release
        assert a.stats.underlying_allocations == 2 + 4, a.stats.underlying_allocations  # + a meta block per step
    else:
        assert idle_after_release == [0, 0, 0, 0], idle_after_release
        assert a.stats.underlying_allocations == 4 * 3, a.stats.underlying_allocations
    monkeypatch.undo()
    assert not A.CachingAllocator().keeps(torch.device("cuda"), 1 << 40)
    assert not A.CachingAllocator().keeps(torch.device("cpu"), A.MAP_FRESH_BYTES - 1)  # malloc keeps those
    assert A.CachingAllocator().keeps(torch.device("cpu"), A.MAP_FRESH_BYTES)


@pytest.mark.parametrize("hold", [True, False])
def test_big_cpu_blocks_are_kept_only_while_the_step_will_ask_for_them(monkeypatch, hold):
    """Blocks glibc maps afresh (here: all) are cached for as long as the rest of the phase, or the
    next phase's opening requests, will take them -- as the last run of that phase says -- and
    given back the moment they are surplus. The sequence is mfsdp2's ZeRO-3 step with prefetch 1:
    backward holds three blocks (two units' weights, a flat gradient in flight) but its last unit
    has no unit left to prefetch, so the third block is surplus from the second-to-last unit's
    reduction on (held idle through the last unit's backward, it was 1/20 of mlp's peak).
    ``hold_between_steps=False``: nothing is kept through the optimizer step either."""
    monkeypatch.setattr(A, "MAP_FRESH_BYTES", 0)
    a = CachingAllocator(hold_between_steps=hold)
    n, U = 100, 4
    seen = []
    for step in range(5):
        a.mark_step()
        _req(a, ("weight", 0), n)
        for u in range(U):
            if u + 1 < U:
                _req(a, ("weight", u + 1), n)
            a.free(("weight", u))
        a.release_idle("backward")
        after_forward = a.idle_bytes() // 400
        _req(a, ("weight", U - 1), n)
        for u in reversed(range(U)):
            if u > 0:
                _req(a, ("weight", u - 1), n)  # pre-backward: prefetch the next unit
            if u == 0:
                last_unit = a.idle_bytes() // 400  # the last unit's backward computes here
            a.free(("weight", u))  # post-backward: reshard, finish the previous reduction, pack
            if u + 1 < U:
                a.free(("grad", u + 1))
            _req(a, ("grad", u), n)
        a.free(("grad", 0))
        tail = a.idle_bytes() // 400  # backward's last free: kept for the forward, or not
        a.release_idle("forward")
        seen.append((after_forward, last_unit, a.idle_bytes() // 400, a.stats.underlying_allocations, tail))
    # Step 0 knows nothing (keeps all within phases, gives back all at their ends but the opening
    # it saw); from step 1 on: two blocks kept across each phase end (what the next phase asks for
    # first), none idle in the last unit's backward, one obtained anew per step (the third).
    if hold:
        assert [s[:3] for s in seen] == [(0, 1, 2)] + [(2, 0, 2)] * 4, seen
        assert [b[3] - a_[3] for a_, b in zip(seen, seen[1:])] == [1, 1, 1, 1], seen
    else:  # nothing kept past backward, not even in its tail; the forward obtains its two anew
        assert [s[:3] for s in seen] == [(0, 1, 0)] + [(2, 0, 0)] * 4, seen
        assert [s[4] for s in seen[1:]] == [0] * 4, seen
        assert [b[3] - a_[3] for a_, b in zip(seen, seen[1:])] == [3, 3, 3, 3], seen


# -- a training step at world size 2 ---------------------------------------------------------------
def _release(rank, ws, allocator, optimizer="torch"):
    torch.manual_seed(0)
    model = _Stack()
    mesh = init_device_mesh("cpu", (ws,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, allocator=allocator)
    model.set_all_reduce_bucket_cap_mb(0)  # the per-unit reductions (buckets: tests/groups/test_grad_buckets.py)
    # mfsdp2's flat AdamW steps the main gradient itself: it must not keep it alive either
    opt = (torch.optim.AdamW if optimizer == "torch" else mfsdp2.optim.AdamW)(model.parameters(), lr=1e-3)
    if allocator != "trace_pool":
        model.allocator  # the property lazily initialises the units before the first forward
    seen = {"idle_in_forward": [], "main_grads_in_forward": [], "idle_after_forward": [],
            "last_main_grad_bytes_in_forward": []}
    refs = []

    def in_forward(mod, args, out):
        a = model.allocator
        seen["idle_in_forward"].append(a.idle_bytes())
        seen["main_grads_in_forward"].append(a.stats.live_by_role.get("main_grad", 0))
        # The last backward's main gradient memory, whoever still views it: freed (the storage is
        # gone, or emptied in place for the next backward to refill), or kept by its holder. gloo's
        # worker thread lets go of a collective's tensors just after the wait returns: given a
        # moment on a loaded machine.
        for _ in range(200):
            last = refs[-1]() if refs else None
            if last is None or last.nbytes() == 0 or len(seen["last_main_grad_bytes_in_forward"]) == 3:
                break
            time.sleep(0.005)
        seen["last_main_grad_bytes_in_forward"].append(last.nbytes() if last is not None else 0)

    model.blocks[B - 1].register_forward_hook(in_forward)
    g = torch.Generator().manual_seed(rank)
    first = model.blocks[0]._mfsdp2_state.groups[0]
    p0 = next(model.blocks[0].parameters())
    grad_ids, kept_values = [], None
    user_grad = None
    for step in range(5):
        x = torch.randn(4, D, generator=g)
        loss = model(x).pow(2).mean()
        seen["idle_after_forward"].append(model.allocator.idle_bytes())  # the loss's moment
        loss.backward()
        refs.append(weakref.ref(first.main_grad.untyped_storage()))  # the memory, whoever views it
        grad_ids.append(id(p0.grad))
        assert p0.grad._local_tensor.data_ptr() == first.weights.piece_view(first.main_grad, 0).data_ptr()
        if step == 2:  # the user keeps a gradient past zero_grad: it must keep its values
            user_grad = p0.grad
            kept_values = user_grad._local_tensor.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gc.collect()
    out = dict(seen)
    out["main_grad_blocks_alive"] = [r() is not None for r in refs]
    out["main_grad_bytes"] = first.main_grad.untyped_storage().nbytes()
    out["grad_ids"] = grad_ids
    out["user_grad_intact"] = bool(torch.equal(user_grad._local_tensor, kept_values))
    out["user_grad_is_current"] = user_grad is p0.grad
    out["idle_after_step"] = model.allocator.idle_bytes()
    out["weight_bytes"] = first.layout.total_numel * 4
    if allocator == "trace_pool":
        a = model.allocator
        out["pools_held_after_step"] = sum(p.nbytes for p in a._pools.values())
        out["pool_phases"] = sorted({pk[2] for pk in a._pools})
    return out


@pytest.mark.parametrize("allocator,optimizer", [("caching", "torch"), ("trace_pool", "torch"), ("caching", "mfsdp2")])
def test_training_step_holds_nothing_idle_where_activations_are_allocated(allocator, optimizer):
    for r in run_ranks(_release, 2, allocator, optimizer):
        steps = len(r["grad_ids"])
        # Forward and the loss: no main gradient, nothing idle (the blocks are small: malloc's).
        assert r["main_grads_in_forward"] == [0] * steps, r
        assert r["idle_after_forward"] == [0] * steps and r["idle_after_step"] == 0, r
        if allocator == "caching" or not compat.HAS_STORAGE_SWAP:
            # Without storage swapping the gathered weights, the forward's only requests, are
            # torch's memory (storage.resize_, buffer.py): the trace pool plans no forward pool.
            assert r["idle_in_forward"] == [0] * steps, r
        else:
            # The forward's pool is held until the forward ends (after the last unit's forward,
            # with prefetch -- planned from step 3 on -- it has two weight slots, both free now).
            assert r["idle_in_forward"][0] == 0 and r["idle_in_forward"][3:] == [2 * r["weight_bytes"]] * 2, r
        # Every step's main gradient memory went back at the next forward, but the one whose
        # gradient the user kept (step 2): emptied in place (the same storage, refilled by the
        # next backward) where nobody else views it, else freed.
        assert r["last_main_grad_bytes_in_forward"] == [0, 0, 0, r["main_grad_bytes"], 0], r
        if allocator == "caching":
            # Steps 0, 1 (one storage, emptied and refilled) and 2 (kept by the user) alive, then
            # a new block for step 3, emptied and refilled for step 4, the one in use.
            assert r["main_grad_blocks_alive"] == [True, True, True, True, True], r
        else:  # a pool's slices are freed
            assert r["main_grad_blocks_alive"] == [False, False, True, False, True], r
        # The gradient DTensors were re-pointed, not rebuilt -- except after the step whose
        # gradient the user kept: that one keeps its values, and a new one is made.
        ids = r["grad_ids"]
        assert ids[0] == ids[1] == ids[2] != ids[3] == ids[4], ids
        assert r["user_grad_intact"] and not r["user_grad_is_current"], r
        if allocator == "trace_pool":
            # without storage swapping only the backward has a pool (flat gradients, reduce-scatter outputs)
            phases = [0, 1] if compat.HAS_STORAGE_SWAP else [1]
            assert r["pools_held_after_step"] == 0 and r["pool_phases"] == phases, r
