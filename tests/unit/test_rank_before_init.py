"""rank(), size() and the local values before init(): the launcher's answer, as jt.rank's."""

from __future__ import annotations

import os

import pytest

import ringflow
from ringflow.errors import ConfigError, NotInitializedError

pytestmark = pytest.mark.timeout(60)

_LAUNCHER_PREFIXES = ("RINGFLOW_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MV2_", "TORCHELASTIC_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "GROUP_WORLD_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variable: what each test sets is all there is."""
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES) or name in _LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    assert not ringflow.is_initialized()
    return monkeypatch


def values() -> tuple[int, ...]:
    return (ringflow.rank(), ringflow.size(), ringflow.local_rank(), ringflow.local_size(),
            ringflow.cross_rank(), ringflow.cross_size())


def test_without_a_launcher_a_process_is_rank_0_of_1(env: pytest.MonkeyPatch) -> None:
    assert values() == (0, 1, 0, 1, 0, 1)
    assert not ringflow.is_initialized()  # answering did not start anything


@pytest.mark.parametrize(("launcher", "expected"), [
    ({"RINGFLOW_RANK": "2", "RINGFLOW_SIZE": "3", "RINGFLOW_LOCAL_RANK": "0",
      "RINGFLOW_LOCAL_SIZE": "1", "RINGFLOW_CROSS_RANK": "2", "RINGFLOW_CROSS_SIZE": "3"},
     (2, 3, 0, 1, 2, 3)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2, 1, 2)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "TORCHELASTIC_RUN_ID": "x"}, (1, 2, 1, 2, 0, 1)),
])
def test_under_a_launcher_its_values(env: pytest.MonkeyPatch, launcher: dict[str, str],
                                     expected: tuple[int, ...]) -> None:
    for name, value in launcher.items():
        env.setenv(name, value)
    assert values() == expected
    assert not ringflow.is_initialized()


def test_local_values_a_launcher_does_not_give_need_init(env: pytest.MonkeyPatch) -> None:
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")  # torch's env:// contract: no LOCAL_* variables
    assert (ringflow.rank(), ringflow.size()) == (1, 2)
    for fn in (ringflow.local_rank, ringflow.local_size, ringflow.cross_rank,
               ringflow.cross_size):
        with pytest.raises(NotInitializedError, match="gives no local rank or size before"):
            fn()


def test_a_job_that_cannot_be_joined_raises_what_init_would(env: pytest.MonkeyPatch) -> None:
    env.setenv("WORLD_SIZE", "4")  # RANK missing: never silently rank 0 of 1
    for fn in (ringflow.rank, ringflow.size):
        with pytest.raises(ConfigError, match="WORLD_SIZE=4 says this job has 4 processes"):
            fn()
