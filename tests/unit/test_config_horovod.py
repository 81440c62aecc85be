"""ringflow.config reads Horovod's tuning variables with their RINGFLOW_* meaning."""

from __future__ import annotations

import logging

import pytest

from ringflow.config import Config, read_horovod_env
from ringflow.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("horovod", "field", "expected", "line"),
    [
        ({"HOROVOD_FUSION_THRESHOLD": "67108864"}, "fusion_threshold_bytes", 64 << 20,
         "HOROVOD_FUSION_THRESHOLD=67108864 read as RINGFLOW_FUSION_THRESHOLD_BYTES=67108864"),
        ({"HOROVOD_FUSION_THRESHOLD": "0"}, "fusion_threshold_bytes", 0,
         "HOROVOD_FUSION_THRESHOLD=0 read as RINGFLOW_FUSION_THRESHOLD_BYTES=0"),
        ({"HOROVOD_CYCLE_TIME": "3.5"}, "cycle_time_ms", 3.5,
         "HOROVOD_CYCLE_TIME=3.5 read as RINGFLOW_CYCLE_TIME_MS=3.5"),
        ({"HOROVOD_CACHE_CAPACITY": "0"}, "cache_capacity", 0,
         "HOROVOD_CACHE_CAPACITY=0 read as RINGFLOW_CACHE_CAPACITY=0"),
        ({"HOROVOD_TIMELINE": "/tmp/tl.json"}, "timeline_path", "/tmp/tl.json",
         "HOROVOD_TIMELINE=/tmp/tl.json read as RINGFLOW_TIMELINE_PATH=/tmp/tl.json"),
        ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "7"}, "stall_warning_s", 7.0,
         "HOROVOD_STALL_CHECK_TIME_SECONDS=7 read as RINGFLOW_STALL_WARNING_S=7"),
        ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}, "stall_shutdown_s", 90.0,
         "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=90 read as RINGFLOW_STALL_SHUTDOWN_S=90"),
        ({"HOROVOD_LOG_LEVEL": "TRACE"}, "log_level", "debug",
         "HOROVOD_LOG_LEVEL=TRACE read as RINGFLOW_LOG_LEVEL=debug"),
        ({"HOROVOD_LOG_LEVEL": "fatal"}, "log_level", "error",
         "HOROVOD_LOG_LEVEL=fatal read as RINGFLOW_LOG_LEVEL=error"),
        ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "12"}, "timeout_s", 12.0,
         "HOROVOD_GLOO_TIMEOUT_SECONDS=12 read as RINGFLOW_TIMEOUT_S=12"),
        ({"HOROVOD_AUTOTUNE": "1"}, "autotune", True,
         "HOROVOD_AUTOTUNE=1 read as RINGFLOW_AUTOTUNE=1"),
        ({"HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv"}, "autotune_log_file", "/tmp/at.csv",
         "HOROVOD_AUTOTUNE_LOG=/tmp/at.csv read as RINGFLOW_AUTOTUNE_LOG_FILE=/tmp/at.csv"),
        ({"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "8"}, "autotune_steps_per_sample", 8,
         "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=8 read as RINGFLOW_AUTOTUNE_STEPS_PER_SAMPLE=8"),
        ({"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1"}, "autotune_warmup_samples", 1,
         "HOROVOD_AUTOTUNE_WARMUP_SAMPLES=1 read as RINGFLOW_AUTOTUNE_WARMUP_SAMPLES=1"),
    ],
)
def test_each_horovod_variable_is_read_with_a_warning(caplog, horovod, field, expected, line):
    with caplog.at_level(logging.WARNING, logger="ringflow.config"):
        config = Config.from_env(horovod)
    assert getattr(config, field) == expected
    assert [r.getMessage() for r in caplog.records] == [line]
    assert caplog.records[0].levelno == logging.WARNING


def test_stall_check_disable_turns_every_stall_limit_off_and_beats_the_times(caplog):
    env = {"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "9"}
    with caplog.at_level(logging.WARNING, logger="ringflow.config"):
        config = Config.from_env(env)
    limits = (config.stall_warning_s, config.stall_shutdown_s, config.deadlock_shutdown_s)
    assert limits == (0, 0, 0)
    assert caplog.messages == [
        "HOROVOD_STALL_CHECK_DISABLE=1 read as RINGFLOW_STALL_WARNING_S=0, "
        "RINGFLOW_STALL_SHUTDOWN_S=0, RINGFLOW_DEADLOCK_SHUTDOWN_S=0"
    ]
    assert Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "0"}) == Config()


def test_dynamic_timeline_is_no_timeline():
    horovod = read_horovod_env({"HOROVOD_TIMELINE": "DYNAMIC"})
    assert horovod.values == {} and horovod.read == ()


def test_an_explicit_ringflow_variable_wins_and_the_horovod_one_is_logged_at_info(caplog):
    env = {"HOROVOD_CYCLE_TIME": "5", "RINGFLOW_CYCLE_TIME_MS": "2"}
    with caplog.at_level(logging.INFO, logger="ringflow.config"):
        assert Config.from_env(env).cycle_time_ms == 2.0
    assert caplog.messages == ["HOROVOD_CYCLE_TIME=5 is ignored: RINGFLOW_CYCLE_TIME_MS=2 is set"]
    assert caplog.records[0].levelno == logging.INFO
    # What ringflow-run passes on (the same value under both names) is not reported at all.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ringflow.config"):
        Config.from_env({"HOROVOD_CYCLE_TIME": "5", "RINGFLOW_CYCLE_TIME_MS": "5.0"})
    assert caplog.messages == []
    # Keyword overrides win over both.
    assert Config.from_env({"HOROVOD_CYCLE_TIME": "5"}, cycle_time_ms=3.0).cycle_time_ms == 3.0


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "ringflow picks the hierarchical allreduce itself"),
        ("HOROVOD_HIERARCHICAL_ALLGATHER", "no hierarchical variant"),
        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "not Bayesian optimisation"),
        ("HOROVOD_TIMELINE_MARK_CYCLES", "ringflow has no cycles to mark"),
    ],
)
def test_horovod_knobs_without_a_ringflow_meaning_say_why(caplog, name, fragment):
    with caplog.at_level(logging.INFO, logger="ringflow.config"):
        assert Config.from_env({name: "1"}) == Config()
        assert Config.from_env({name: "0"}) == Config()  # off: nothing to say
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.WARNING
    assert caplog.messages[0].startswith(f"{name}=1 has no effect: ")
    assert fragment in caplog.messages[0]


def test_workers_of_ringflow_run_log_the_notes_at_info(caplog):
    """ringflow-run reports them once; its workers would say the same thing once per rank."""
    env = {"HOROVOD_HIERARCHICAL_ALLGATHER": "1", "HOROVOD_CACHE_CAPACITY": "5",
           "RINGFLOW_LAUNCHER_PID": "1"}
    with caplog.at_level(logging.INFO, logger="ringflow.config"):
        assert Config.from_env(env).cache_capacity == 5
    assert len(caplog.records) == 2
    assert {r.levelno for r in caplog.records} == {logging.INFO}


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"HOROVOD_FUSION_THRESHOLD": "64MB"},
         "HOROVOD_FUSION_THRESHOLD='64MB' is not an integer number of bytes (Horovod's meaning; "
         "ringflow reads it as RINGFLOW_FUSION_THRESHOLD_BYTES)"),
        ({"HOROVOD_CYCLE_TIME": "fast"}, "HOROVOD_CYCLE_TIME='fast' is not a number of millisec"),
        ({"HOROVOD_LOG_LEVEL": "loud"},
         "HOROVOD_LOG_LEVEL='loud' is not one of trace, debug, info, warning, error, fatal"),
        ({"HOROVOD_CYCLE_TIME": "0"},
         "HOROVOD_CYCLE_TIME='0' (read as RINGFLOW_CYCLE_TIME_MS=0.0) is out of range; the "
         "default is 1.0"),
        ({"HOROVOD_CACHE_CAPACITY": "-1"},
         "HOROVOD_CACHE_CAPACITY='-1' (read as RINGFLOW_CACHE_CAPACITY=-1) is out of range"),
    ],
)
def test_bad_horovod_values_name_the_horovod_variable(env, fragment):
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert fragment in str(info.value)


def test_ringflow_range_errors_still_name_the_ringflow_variable():
    with pytest.raises(ConfigError, match=r"^RINGFLOW_CYCLE_TIME_MS=0\.0 is out of range"):
        Config.from_env({"RINGFLOW_CYCLE_TIME_MS": "0", "HOROVOD_CACHE_CAPACITY": "3"})


def test_switches_and_the_wire_formats_are_checked():
    assert Config.from_env({"RINGFLOW_AUTOTUNE": "on"}).autotune is True
    assert Config.from_env({"RINGFLOW_AUTOTUNE": "0"}).autotune is False
    with pytest.raises(ConfigError, match="RINGFLOW_AUTOTUNE='maybe' is not one of"):
        Config.from_env({"RINGFLOW_AUTOTUNE": "maybe"})
    with pytest.raises(ConfigError, match="RINGFLOW_WIRE_COMPRESSION='fp8' is out of range"):
        Config.from_env({"RINGFLOW_WIRE_COMPRESSION": "fp8"})
    with pytest.raises(ConfigError, match="RINGFLOW_CHUNK_BYTES=100 is out of range"):
        Config.from_env({"RINGFLOW_CHUNK_BYTES": "100"})
