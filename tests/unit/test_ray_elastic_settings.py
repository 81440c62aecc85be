"""ringflow.ray.ElasticRayExecutor without a Ray cluster: Horovod's settings and arguments, and
how a discovery's keys name Ray nodes. On a cluster: tests/multiproc/test_ray_elastic.py."""

from __future__ import annotations

import pytest

from ringflow.errors import ConfigError
from ringflow.ray import ElasticRayExecutor, ElasticRaySettings
from ringflow.ray.elastic import _node_of, _slots

pytestmark = pytest.mark.timeout(60)


def test_create_settings_takes_horovods_names_and_deprecated_aliases():
    s = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, reset_limit=3,
                                           elastic_timeout=60, timeout_s=5, nics=["lo"],
                                           cooldown_range=(1, 8))
    assert s == ElasticRaySettings(2, 4, 3, 60.0, 5.0, ("lo",), (1.0, 8.0), None, 1.0)
    with pytest.warns(DeprecationWarning):
        old = ElasticRayExecutor.create_settings(min_np=2, max_np=3)
    assert (old.min_num_proc, old.max_num_proc) == (2, 3)
    assert ElasticRayExecutor.create_settings().max_num_proc is None  # unbounded


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"min_num_proc": 0}, "1 <= min_num_proc"),
    ({"min_num_proc": 3, "max_num_proc": 2}, "min_num_proc <= max_num_proc"),
    ({"elastic_timeout": 0}, "elastic_timeout=0.0"),
    ({"timeout_s": -1}, "timeout_s=-1.0"),
    ({"reset_limit": -1}, "reset_limit=-1"),
    ({"cooldown_range": (5, 1)}, "0 < low <= high"),
])
def test_bad_settings_name_the_argument(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        ElasticRayExecutor.create_settings(**kwargs)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"gpus_per_slot": 1}, "needs use_gpu=True"),
    ({"cpus_per_slot": 0}, "must reserve some CPU or GPU"),
    ({"override_discovery": False}, "create_settings(discovery=...)"),
])
def test_bad_arguments_name_the_fix(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), **kwargs)
    with pytest.raises(ConfigError, match="create_settings"):
        ElasticRayExecutor(object())  # type: ignore[arg-type]


def test_a_discovery_names_nodes_by_id_or_by_an_ip_of_one_node():
    nodes = [{"NodeID": "aa", "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "bb", "NodeManagerAddress": "127.0.0.1"},
             {"NodeID": "cc", "NodeManagerAddress": "127.0.0.1"}]
    assert _node_of("bb", nodes) == "bb"
    assert _node_of("10.0.0.1", nodes) == "aa"
    assert _node_of("127.0.0.1", nodes) is None  # two raylets on one address: ambiguous
    assert _node_of("dd", nodes) is None


@pytest.mark.parametrize(("free", "per", "slots"), [(3, 1, 3), (3, 1.5, 2), (2.9999999999, 1, 3),
                                                    (0.5, 1, 0), (4, 0, 2**31 - 1)])
def test_slots_of_free_resources(free, per, slots):
    assert _slots(free, per) == slots
