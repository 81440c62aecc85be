"""Call sites for stall reports: the user's frame, never ringflow's or a framework's."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import ringflow as rf
from ringflow.submission import call_site

pytestmark = pytest.mark.timeout(30)


def here() -> str:
    return call_site(1)


def test_the_first_frame_outside_ringflow_is_the_call_site() -> None:
    line = here.__code__.co_firstlineno + 1
    assert here() == f"{__file__}:{line}"
    internal = {"__name__": "ringflow.fake"}  # a frame of ringflow's between: skipped
    exec("def inner():\n    return call_site(1)\n", {**internal, "call_site": call_site}, internal)
    site, line = internal["inner"](), sys._getframe().f_lineno
    assert site == f"{__file__}:{line}"


def test_submit_records_the_site_of_a_new_name_and_not_of_a_cached_one() -> None:
    rf.init()
    try:
        eng = rf.running()
        seen = []
        enqueue = eng.enqueue_many

        def spy(items):
            seen.extend(req.site for req, _, _ in items)
            return enqueue(items)

        eng.enqueue_many = spy
        for _ in range(2):
            rf.allreduce(np.ones(2), name="site.test")  # the call site
        line = test_submit_records_the_site_of_a_new_name_and_not_of_a_cached_one.__code__
        assert seen[0].startswith(f"{__file__}:") and seen[1] == "", seen
        assert int(seen[0].rsplit(":", 1)[1]) > line.co_firstlineno
    finally:
        rf.shutdown()
