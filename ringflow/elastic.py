"""Elastic training, framework-neutral: Horovod's ``hvd.elastic`` states and ``run`` loop.

The adapters (:mod:`ringflow.torch.elastic`) add their state handlers and nothing else; the
re-forming world is :mod:`ringflow.world` (the worker) and :mod:`ringflow.runner.elastic` (the
driver, ``ringflow-run --host-discovery-script``).

``run(train)(state, ...)`` loops, as Horovod 0.28's ``run_fn`` does:

1. ``state.sync()``: every tracked value goes from rank 0 to every rank (rank 0 is always a
   worker of the previous generation, which holds the committed state);
2. ``train(state, ...)``; its result is ``run``'s;
3. on :class:`~ringflow.errors.HorovodInternalError` (a peer died, the job's collectives
   failed): ``state.restore()`` to the last ``commit()``; on
   :class:`~ringflow.errors.HostsUpdatedInterrupt` (raised by ``commit()``): nothing is undone;
4. the reset: ``shutdown()``, ``init()`` (the next generation, :mod:`ringflow.world`), the
   state's reset callbacks; then 1 again.

Where it differs from Horovod, on purpose: every reset syncs (Horovod skips ``sync()`` after an
interrupt that only removed hosts, which leaves ``ElasticSampler`` on its old shards and repeats
samples, #3399, and deadlocks when newcomers do sync, #3494); a failure inside ``sync()`` rolls
back and resets like one in ``train`` (Horovod lets it end the job, #2995); ``commit()`` decides
host updates from every rank's view (an allreduce of the maximum), not from rank 0's alone; and
:class:`ObjectState` keeps deep copies, so that a value changed in place after ``commit()`` is
still rolled back.

**Under torchrun** (``--max-restarts``, ``--nnodes MIN:MAX``) there is no world to re-form in
place: torchrun's agent stops and restarts every worker after a failure or a membership change.
What can outlive the workers is its agent store, in the agent's memory: there ``commit()`` on
rank 0 also puts the saved state (pickled; keys under ``ringflow/<run id>/elastic/``), and a
restarted job's rank 0 takes it back before the first ``sync()``, so the training resumes from
the last commit, not from the user's checkpoint. A failure inside ``train`` is then raised at
once (the agent restarts the workers). That put costs a pickle and a send of the whole state a
commit (commit less often for a large model); the store is as protected as torchrun's.

:func:`shard` is the sampler's arithmetic (``ElasticSampler`` in the adapters): the indices of
an epoch (shuffled with ``seed + epoch`` as Horovod does), without the first ``processed`` ones,
rank ``r`` taking positions ``r, r + size, ...`` -- no padding, so every sample is seen exactly
once per epoch; after ``k`` full steps of ``b`` samples a rank, the processed ones are exactly
the first ``k * b * size``, whatever the sizes of the generations were.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from . import Max, allreduce, init, rank, runtime, shutdown
from ._adapter import broadcast_object
from .bootstrap import torchrun_store
from .errors import HorovodInternalError, HostsUpdatedInterrupt, RingflowTimeoutError

__all__ = ["ObjectState", "PartsState", "State", "run", "run_fn", "shard"]

log = logging.getLogger(__name__)


class State:
    """What an elastic ``train`` function keeps across resets (Horovod's ``State``).

    ``bcast_object(obj)`` sends rank 0's ``obj`` to every rank; ``get_rank()`` is this rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (e.g. to scale the learning rate to the
        new ``size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (what a failure rolls back to), then
        :meth:`check_host_updates`. Collective: every rank calls it at the same step.

        Raises:
            HostsUpdatedInterrupt: the job is to re-form (workers wait to join, a host left).
        """
        self.save()
        _keep(self)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank alike when the driver asked the
        running generation to re-form. Collective (one allreduce of one number)."""
        world = runtime.world()
        mine = 1 if world is not None and world.update_pending() else 0
        agreed = allreduce(np.array([mine], np.int32), name="elastic.host_updates", op=Max)
        if int(agreed[0]):
            raise HostsUpdatedInterrupt("the elastic job re-forms: workers wait to join or a "
                                        "host left the discovery script's list")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def saved(self) -> Any:
        """What :meth:`save` keeps (picklable): kept in torchrun's agent store between restarts."""
        raise NotImplementedError

    def load_saved(self, saved: Any) -> None:
        """Make ``saved`` (a :meth:`saved` of this kind of state) what :meth:`restore` restores."""
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values as attributes (Horovod's ``ObjectState``): ``ObjectState(epoch=0,
    batch=0)`` gives ``state.epoch``; ``save()`` keeps deep copies of them, ``restore()`` sets
    copies back, ``sync()`` sends rank 0's saved values to every rank."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = rank, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def saved(self) -> Any:
        return {"values": self._saved_state}

    def load_saved(self, saved: Any) -> None:
        self._saved_state = saved["values"]

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            object.__setattr__(self, attr, copy.deepcopy(value))


class PartsState(ObjectState):
    """An ObjectState that also saves, restores, syncs and hands over its ``parts``: framework
    objects wrapped so that each has ``save()``, ``restore()``, ``sync()`` and its ``saved``
    value (the torch and TensorFlow states), by name."""

    def __init__(self, parts: dict[str, Any],
                 bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = rank, **kwargs: Any) -> None:
        object.__setattr__(self, "_parts", parts)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank, **kwargs)

    def save(self) -> None:
        for part in self._parts.values():
            part.save()
        super().save()

    def restore(self) -> None:
        for part in self._parts.values():
            part.restore()
        super().restore()

    def sync(self) -> None:
        for part in self._parts.values():
            part.sync()
        super().sync()

    def saved(self) -> Any:
        return {"parts": {name: part.saved for name, part in self._parts.items()},
                **super().saved()}

    def load_saved(self, saved: Any) -> None:
        for name, part in self._parts.items():
            part.saved = saved["parts"][name]
        super().load_saved(saved)


def _reset() -> None:
    """``shutdown(); init()``. In an elastic job, an ``init()`` that fails because a peer of the
    new generation failed too asks for the next one (the driver's --reset-limit and
    --elastic-timeout bound the tries); elsewhere (a fixed-size job) its error is raised."""
    shutdown()
    while True:
        try:
            init()
            return
        except (HorovodInternalError, RingflowTimeoutError) as exc:
            if runtime.world() is None:
                raise
            log.warning("joining the next generation failed (%s); asking for another", exc)
            shutdown()


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """``func`` wrapped in the elastic loop of the module doc, with ``reset`` between tries."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _resume(state)
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                if _under_torchrun():
                    log.info("%s; torchrun restarts the workers, which resume from the last "
                             "commit", exc)
                    raise
                log.info("rolling back to the last commit: %s", exc)
                state.restore()
            except HostsUpdatedInterrupt as exc:
                log.info("%s", exc)
            reset()
            state.on_reset()

    return wrapper


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run`` decorator: ``func(state, ...)`` survives workers leaving
    and joining (see the module doc). The reset is ``shutdown(); init()``."""
    return run_fn(func, _reset)


_keepers: list[Any] = []  # torchrun's agent store, once opened


def _under_torchrun() -> bool:
    """A torchrun job (its agent store in use) outside a ringflow elastic job."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and runtime.world() is None)


def _keeper() -> Any:
    """torchrun's agent store, keys under ``ringflow/<run id>/elastic/``."""
    if not _keepers:
        _keepers.append(torchrun_store("elastic", runtime.running().config.timeout_s))
    return _keepers[0]


def _keep(state: State) -> None:
    """Under torchrun, rank 0 puts the state just saved in the agent's store (then counts the
    commit: a count above 0 says a whole state is there)."""
    if _under_torchrun() and rank() == 0:
        keeper = _keeper()
        keeper.set("state", pickle.dumps(state.saved(), protocol=pickle.HIGHEST_PROTOCOL))
        keeper.add("commits", 1)


def _resume(state: State) -> None:
    """Under torchrun, after a restart: rank 0 takes back the last commit the agent's store
    kept (the first ``sync()`` then sends it to every rank)."""
    if (not _under_torchrun() or rank() != 0
            or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0):
        return
    keeper = _keeper()
    if keeper.add("commits", 0) == 0:
        log.info("no commit kept from before torchrun's restart: starting from the beginning")
        return
    state.load_saved(pickle.loads(keeper.get("state")))  # put there by this job's rank 0
    state.restore()
    log.info("resumed from the last commit kept in torchrun's agent store")


def shard(length: int, epoch: int, seed: int, shuffle: bool, processed: int, rank: int,
          size: int) -> list[int]:
    """Rank ``rank``'s indices of the rest of an epoch of ``length`` samples (module doc)."""
    order = list(range(length))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order[processed:][rank::size]
