"""ringflow on a Ray cluster: :class:`RayExecutor`, in the manner of ``horovod.ray.RayExecutor``.

::

    import ray
    import ringflow.torch as hvd
    from ringflow.ray import RayExecutor

    ray.init(address="auto")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()

    def train(lr):
        hvd.init()                      # unchanged: the actor has ringflow's environment
        ...
        return hvd.rank()

    results = executor.run(train, args=[0.1])  # [0, 1, 2, 3]: every rank's result, in rank order
    executor.shutdown()

Each rank is a Ray actor with the environment that ``ringflow-run`` gives a worker (DESIGN.md
section 5), its secret on an inherited-style pipe, and a rendezvous store served by the driver;
see :mod:`ringflow.ray.executor` for placement, ranking, failures and shutdown. ``import
ringflow`` does not import this package, and this package imports Ray only when an executor is
created (``pip install 'ringflow[ray]'``).

Differences from ``horovod.ray``: a failure on one rank (an exception or a dead actor) ends the
job and is raised on the driver as :class:`~ringflow.errors.RankFailure` naming the first failed
rank (Horovod re-raises Ray's error of whichever rank ``ray.get`` meets first and leaves the other
actors running, possibly blocked in a collective); ``run``/``execute``/``execute_single`` take a
``timeout``; ``shutdown`` waits until the actors are gone; the rendezvous store listens on
127.0.0.1 when every actor is on the driver's node; Ray Client and the ``callbacks`` of
``run``/``execute`` are not supported; the ssh arguments of ``create_settings`` are accepted and
ignored. Elastic jobs: :class:`ElasticRayExecutor` (:mod:`ringflow.ray.elastic`), Horovod's
``ElasticRayExecutor``, over ringflow-run's elastic driver.
"""

from __future__ import annotations

from .elastic import ElasticRayExecutor, ElasticRaySettings, RayHostDiscovery
from .executor import FAILURE_GRACE_S, RayExecutor, RaySettings

__all__ = ["FAILURE_GRACE_S", "ElasticRayExecutor", "ElasticRaySettings", "RayExecutor",
           "RayHostDiscovery", "RaySettings"]
