"""``tensors_in`` / ``map_tensors`` on the containers model code passes through a unit.

The plain ``tuple`` / ``list`` / ``dict`` fast path must find and replace exactly what the general
walk does, and subclasses (named tuples, a ``dict`` or ``list`` subclass, a dataclass that is also
a ``dict``) must keep their types and fields.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from mfsdp2.base.structures import map_tensors, tensors_in

Pair = collections.namedtuple("Pair", "a b")


class Tagged(list):
    pass


class Config(dict):
    def __init__(self, items=(), tag="x"):
        super().__init__(items)
        self.tag = tag


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: dict


@dataclasses.dataclass(frozen=True)
class Out:
    y: torch.Tensor
    n: int


def _sample():
    t = [torch.full((1,), float(i)) for i in range(8)]
    obj = (t[0], [t[1], (t[2], {"k": t[3], "n": 3})], Pair(t[4], "s"), Tagged([t[5]]),
           Batch(t[6], {"m": t[7]}), Out(t[0], 1), Config({"c": t[1]}))
    return obj, t


def test_tensors_in_finds_every_occurrence():
    obj, t = _sample()
    found = tensors_in(obj)
    assert sorted(id(x) for x in found) == sorted(id(x) for x in [t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7],
                                                                  t[0], t[1]])


def test_map_tensors_replaces_everything_and_keeps_types():
    obj, t = _sample()
    new = map_tensors(lambda x: x + 100, obj)
    assert type(new) is tuple
    assert [float(x) for x in tensors_in(new)] == [float(x) + 100 for x in tensors_in(obj)]
    assert type(new[1]) is list and type(new[1][1]) is tuple and type(new[1][1][1]) is dict
    assert new[1][1][1]["n"] == 3
    assert type(new[2]) is Pair and new[2].b == "s"
    assert type(new[3]) is Tagged
    assert type(new[4]) is Batch and type(new[5]) is Out and new[5].n == 1
    assert obj[4].x is t[6]  # the caller's dataclass is not mutated
    assert isinstance(new[6], Config)


def test_map_tensors_returns_unchanged_containers_as_they_are():
    obj, _ = _sample()
    same = map_tensors(lambda x: x, obj)
    assert same is obj
