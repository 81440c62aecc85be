"""``ringflow.init(rank=, size=, store=)``: the path torch.distributed's backend joins through."""

from __future__ import annotations

import pickle

import pytest

import ringflow
from ringflow.errors import ConfigError
from ringflow.rendezvous import MemoryStore


def test_store_needs_rank_and_size() -> None:
    with pytest.raises(ConfigError, match="needs rank= and size= too"):
        ringflow.init(store=MemoryStore(5.0))
    assert not ringflow.is_initialized()


def test_store_and_init_method_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="give one of them"):
        ringflow.init(rank=0, size=2, store=MemoryStore(5.0), init_method="env://")
    assert not ringflow.is_initialized()


def test_a_job_of_one_on_a_given_store_uses_it_for_the_client() -> None:
    store = MemoryStore(5.0)
    ringflow.init(rank=0, size=1, store=store)
    try:
        assert (ringflow.rank(), ringflow.size()) == (0, 1)
        ringflow.get_client().user_set("k", [1, 2])
        assert pickle.loads(store.get("user/k")) == [1, 2]  # no per-init() prefix
    finally:
        ringflow.shutdown()
