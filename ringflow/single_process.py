"""Code that runs as in one process: Jittor's ``single_process_scope``.

Validation, checkpointing and logging are often written for one process. Two forms:

- ``@single_process_scope()`` (or bare ``@single_process_scope``) on a function: the function
  runs on ``root_rank`` only, inside the local mode below, and every rank returns its result
  (an exception it raises is raised on every rank, with its type kept when it pickles).
  Steps:

  1. every rank counts the call (``n``: the same on every rank, because every rank calls the
     function, Jittor's rule; never reset, so no key is reused after a re-init);
  2. the root runs the function, pickles ``("value", result)`` or ``("error", exception)`` and
     sets it under the store key ``ringflow.single_process_scope/<n>``;
  3. the other ranks wait for that key on the job's store (:func:`ringflow.get_client`), not in a
     collective: the root's function may run for as long as it likes without the stall
     inspector taking the waiting ranks for stalled (a warning after 60 s, the end of the job
     after 600 s), and without holding a connection's data plane.

  Cost: one store write of the pickled result and one read per other rank. Keys are not
  deleted (one per call, the size of the result). The result must pickle (``pickle``) to at most
  the store's 64 MiB; otherwise every rank raises a TypeError saying so.

- ``with single_process_scope():`` -- the *local mode*: the block runs on every rank that enters
  it (Python cannot skip a ``with`` body), and inside it ringflow's automatic distribution acts
  as in one process: ``ringflow.torch.auto`` neither shards DataLoaders, nor averages gradients,
  nor synchronises BatchNorm, and :mod:`ringflow.metrics` reduces nothing. That makes it safe
  to enter on some ranks only (``if ringflow.rank() == 0: with single_process_scope(): ...``),
  which is what Jittor's ``if jt.rank == 0:`` blocks needed and could not have. Collectives
  called explicitly inside still need every rank of their process set.

The mode is per thread (ranks that are threads of one process, :mod:`ringflow.testing`, do not
see each other's). ``ringflow.rank()`` and ``size()`` keep their values inside.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

from .errors import ConfigError, RingflowTimeoutError

__all__ = ["in_single_process_scope", "single_process_scope"]

F = TypeVar("F", bound=Callable[..., Any])



class _Local(threading.local):
    depth = 0  # nesting of the local mode on this thread (a class default: no AttributeError)


_local = _Local()
# Calls made so far by this process: never reset, so that a key is never reused, even after
# shutdown() and init() (the store keeps its keys for the whole job). A rank that is a thread
# of ringflow.testing.run_engines counts per binding (each run has a fresh store).
_calls = itertools.count()
_binding_calls: weakref.WeakKeyDictionary[Any, itertools.count[int]] = \
    weakref.WeakKeyDictionary()
_KEY = "ringflow.single_process_scope/{}"
#: How long one wait for the root's result lasts before it is retried (there is no overall
#: limit: the root's function may take hours; a root that dies ends the job through its launcher).
_POLL_S = 60.0


def in_single_process_scope() -> bool:
    """Whether this thread is inside :func:`single_process_scope` (the local mode)."""
    return _local.depth > 0


@contextlib.contextmanager
def _local_mode() -> Iterator[None]:
    _local.depth = _local.depth + 1
    try:
        yield
    finally:
        _local.depth -= 1


class _Scope:
    """What :func:`single_process_scope` returns: a decorator and a context manager."""

    def __init__(self, root_rank: int) -> None:
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
            raise ConfigError(f"single_process_scope(root_rank={root_rank!r}): expected a rank "
                              ">= 0")
        self.root_rank = root_rank
        self._stack: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        mode = _local_mode()
        mode.__enter__()
        self._stack.append(mode)

    def __exit__(self, *exc: object) -> None:
        self._stack.pop().__exit__(*exc)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return _run_on_root(self.root_rank, fn, args, kwargs)

        return run  # type: ignore[return-value]


@overload
def single_process_scope(root_rank: int = 0) -> _Scope: ...


@overload
def single_process_scope(root_rank: F) -> F: ...


def single_process_scope(root_rank: Any = 0) -> Any:
    """Run a function on ``root_rank`` only and give its result to every rank (decorator), or
    act as one process inside a block (context manager); see the module doc.

    ``@single_process_scope`` without parentheses is ``@single_process_scope()``. Jittor's
    ``@jt.single_process_scope(rank=0)`` is ``@ringflow.single_process_scope(root_rank=0)``.

    Raises:
        ConfigError: ``root_rank`` is not a rank of the job (at the call, on every rank).
    """
    if callable(root_rank):
        return _Scope(0)(root_rank)
    return _Scope(root_rank)


def _run_on_root(root: int, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    from . import runtime

    n = runtime.size()
    if root >= n:
        raise ConfigError(f"single_process_scope(root_rank={root}): the job has {n} ranks; "
                          f"pass a rank below {n}")
    if n == 1 or in_single_process_scope():
        with _local_mode():
            return fn(*args, **kwargs)
    runtime.init()  # nothing to do when initialized; Jittor-style scripts never call it
    me = runtime.rank()
    key = _KEY.format(next(_counter()))
    client = runtime.get_client()
    if me == root:
        try:
            with _local_mode():
                outcome: tuple[str, Any] = ("value", fn(*args, **kwargs))
        except Exception as exc:
            client.user_set(key, ("error", _portable(exc)))
            raise
        try:
            client.user_set(key, outcome)
        except Exception as exc:  # not picklable, or larger than the store takes (64 MiB)
            error = TypeError(f"{_name(fn)} returned a value that cannot be handed to the other "
                              f"ranks ({type(exc).__name__}: {exc}); return something "
                              "picklable and below 64 MiB (numbers, strings, tensors, dicts of "
                              "them), and pass larger objects through a file")
            client.user_set(key, ("error", error))
            raise error from exc
        return outcome[1]
    while True:
        try:
            kind, payload = client.user_get(key, _POLL_S)
            break
        except RingflowTimeoutError:
            continue
    if kind == "error":
        if hasattr(payload, "add_note"):  # Python 3.11+
            payload.add_note(f"raised by {_name(fn)} on rank {root} "
                             "(ringflow.single_process_scope)")
        raise payload
    return payload


def _counter() -> itertools.count[int]:
    from . import runtime

    binding = runtime._local.binding
    if binding is None:
        return _calls
    return _binding_calls.setdefault(binding, itertools.count())


def _portable(exc: Exception) -> Exception:
    """``exc`` if it pickles (and unpickles), else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
