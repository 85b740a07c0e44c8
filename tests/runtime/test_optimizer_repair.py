"""Restoring optimizer lists collapsed by ``data_ptr()`` matching (mfsdp2/runtime/optimizer_repair.py):
only when exactly one original is consistent with the model's parameter order; otherwise nothing
changes (and the step guard raises E61). Plain tensors stand for the parameters: empty ones are
this rank's pieces without rows, whose ``data_ptr()`` is 0."""

from __future__ import annotations

import torch

from mfsdp2.runtime.optimizer_repair import restore_collapsed


class _Opt:
    def __init__(self, *groups):
        self.param_groups = [{"params": list(g)} for g in groups]


def _model(spec: str):
    """One parameter per letter: lower case empty on this rank, upper case holding rows."""
    params = [torch.nn.Parameter(torch.zeros(0 if c.islower() else 2)) for c in spec]
    return params, {id(p): i for i, p in enumerate(params)}, {id(p): p for p in params}


def _collapse(groups, params):
    """What ``prepare`` does: every empty parameter becomes the last empty one of the model."""
    last = [p for p in params if p.numel() == 0][-1]
    return [[last if p.numel() == 0 else p for p in g] for g in groups]


def test_one_group_is_restored():
    params, order, by_id = _model("AbCdeF")
    opt = _Opt(*_collapse([params], params))
    assert restore_collapsed(opt, order, by_id) == 3
    assert opt.param_groups[0]["params"] == params


def test_groups_are_restored_where_neighbours_decide():
    params, order, by_id = _model("AbCDeF")
    groups = [params[:3], params[3:]]
    opt = _Opt(*_collapse(groups, params))
    assert restore_collapsed(opt, order, by_id) == 2
    assert [g["params"] for g in opt.param_groups] == groups


def test_ambiguous_groups_are_left_alone():
    """Decay / no-decay groups whose empty pieces have no neighbours to tell them apart."""
    params, order, by_id = _model("AbcDeFg")
    groups = [[params[0], params[3], params[5]], [params[1], params[2], params[4]], [params[6]]]
    opt = _Opt(*_collapse(groups, params))
    assert restore_collapsed(opt, order, by_id) is None


def test_ambiguous_lists_are_left_alone():
    """Two groups of one collapsed parameter each, with nothing around them: either could have
    held either parameter."""
    params, order, by_id = _model("ab")
    opt = _Opt(*_collapse([[params[0]], [params[1]]], params))
    before = [list(g["params"]) for g in opt.param_groups]
    assert restore_collapsed(opt, order, by_id) is None
    assert [g["params"] for g in opt.param_groups] == before


def test_duplicates_of_a_parameter_with_rows_are_not_a_collapse():
    params, order, by_id = _model("Ab")
    opt = _Opt([params[0], params[0], params[1]])
    assert restore_collapsed(opt, order, by_id) is None
