"""What recording the user's call site costs per submission (stall reports, issue 18).

    python benchmarks/call_site_cost.py [--calls 200000] [--repeats 7]

``ringflow.submission._site_for`` runs on every submission: for a name the response cache knows
it is one dictionary lookup (the site of the name's negotiation is reused); for a new name it
walks the stack to the first frame outside ringflow and the frameworks
(:func:`ringflow.submission.call_site`). The walk is timed under stacks of ``depth`` ringflow
frames (2: ``ringflow.allreduce_async``; 4: ``ringflow.allreduce``; 8: an adapter called from a
framework's hook), minus the same stack calling a function that does nothing. Median over
``--repeats`` runs of ``--calls`` calls, with the spread.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from types import SimpleNamespace

from ringflow.submission import _site_for


def _stack(depth: int, call: str, **names: object) -> object:
    """A function that evaluates ``call`` through ``depth`` frames of a module named ringflow.*
    (``depth - 1`` of them above the one evaluating it, as submit() is below the API)."""
    namespace: dict = {"__name__": "ringflow.bench", **names}
    src = f"def f0():\n    return {call}\n"
    for i in range(1, depth):
        src += f"def f{i}():\n    return f{i - 1}()\n"
    exec(src, namespace)
    return namespace[f"f{depth - 1}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    eng = SimpleNamespace(cache=SimpleNamespace(bit_of={(0, "cached"): 0}))

    def per_call(fn: object) -> list[float]:
        return [t / args.calls * 1e6 for t in timeit.repeat(fn, number=args.calls,
                                                             repeat=args.repeats)]

    def show(what: str, times: list[float], base: list[float]) -> None:
        cost = [t - b for t, b in zip(times, base, strict=True)]
        print(f"{what:<44} {statistics.median(cost):6.2f} us  ({min(cost):.2f}-{max(cost):.2f})")

    for depth in (2, 4, 8):
        base = per_call(_stack(depth, "noop(eng, 'new', 0)", eng=eng, noop=lambda *a: ""))
        for name in ("new", "cached"):
            show(f"{name} name, {depth} ringflow frames", per_call(_stack(
                depth, f"site(eng, {name!r}, 0)", eng=eng, site=_site_for)), base)

if __name__ == "__main__":
    main()
