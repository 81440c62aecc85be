"""TorchState's commit copies into the tensors of the previous one (ringflow.torch.elastic._kept):
the same values and structure as a deep copy, nothing shared with the live objects, no new
tensor after the first commit."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from ringflow.torch.elastic import _kept  # noqa: E402


def _trained() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_commit_is_a_deep_copy_that_reuses_the_previous_tensors():
    model, opt = _trained()
    first_model, first_opt = _kept(None, model.state_dict()), _kept(None, opt.state_dict())
    assert _equal(first_model, copy.deepcopy(model.state_dict()))
    assert first_model._metadata == model.state_dict()._metadata  # load_state_dict reads it
    assert _equal(first_opt, copy.deepcopy(opt.state_dict()))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # the live tensors change in place; the saved ones do not
    assert not _equal(first_model, model.state_dict())
    tensors = [id(t) for t in first_model.values()] + [
        id(t) for s in first_opt["state"].values() for t in s.values()]
    again_model = _kept(first_model, model.state_dict())
    again_opt = _kept(first_opt, opt.state_dict())
    assert _equal(again_model, model.state_dict()) and _equal(again_opt, opt.state_dict())
    assert [id(t) for t in again_model.values()] + [
        id(t) for s in again_opt["state"].values() for t in s.values()] == tensors
    live = {t.data_ptr() for t in model.state_dict().values()}
    assert not live & {t.data_ptr() for t in again_model.values()}


def test_a_tensor_of_another_shape_or_dtype_is_copied_anew():
    old = {"w": torch.zeros(3), "b": torch.zeros(2)}
    new = {"w": torch.ones(4), "b": torch.ones(2, dtype=torch.float64), "n": 5}
    got = _kept(old, new)
    assert _equal(got, new) and got["w"] is not old["w"] and got["b"] is not old["b"]


def test_a_sync_keeps_each_ranks_error_feedback_and_takes_the_rest_from_rank_0():
    from ringflow.compressed import synced_state

    rank0 = {"compression": "powersgd:rank=2", "active": True, "errors": {"w": "rank 0's"},
             "factors": {"w": "Q"}, "steps": {"w": 7}, "server": {"w": "rank 0's chunk"}}
    mine = {"compression": "powersgd:rank=2", "active": True, "errors": {"w": "mine"},
            "factors": {}, "steps": {}, "server": {"w": "my chunk"}}
    got = synced_state(rank0, mine)
    assert got == {"compression": "powersgd:rank=2", "active": True, "errors": {"w": "mine"},
                   "factors": {"w": "Q"}, "steps": {"w": 7}, "server": {}}


def test_torch_state_saved_is_what_a_restarted_process_restores():
    """torchrun's agent store keeps ``saved()`` pickled between restarts: loaded into the state
    of a fresh model and optimizer, ``restore()`` gives them the committed values."""
    import pickle

    from ringflow.torch.elastic import TorchState

    model, opt = _trained()
    state = TorchState(model, opt, step=4)
    committed = copy.deepcopy((model.state_dict(), opt.state_dict()))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # after the commit
    fresh_model = copy.deepcopy(model)  # the values after the commit; no optimizer state yet
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    assert not _equal(fresh_model.state_dict(), committed[0])
    fresh = TorchState(fresh_model, fresh_opt, step=0)
    fresh.load_saved(pickle.loads(pickle.dumps(state.saved())))
    fresh.restore()
    assert fresh.step == 4
    assert _equal(fresh_model.state_dict(), committed[0])
    assert _equal(fresh_opt.state_dict()["state"], committed[1]["state"])
