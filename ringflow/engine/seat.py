"""The coordinator seat: who coordinates, and this rank's side of it.

Rank 0 coordinates (:class:`~ringflow.negotiation.Coordinator`: requests in, plans out) until it
shuts down cleanly while others go on; its last act is a :class:`~ringflow.messages.Handover`
naming the lowest rank still there, which takes the seat. Plans and handovers form one stream,
numbered across coordinators (``seq``), that every rank takes in in order whatever connection
each arrived on: a successor's first plan or the next handover may overtake the old
coordinator's last plan (different senders, different connections). What arrives ahead of its
turn waits in ``early_stream``; submissions that reach a successor before its Handover wait in
``early_submits``. Everything here runs under the engine's control lock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import injection
from ..autotune import Params, Tuner, fixed_knobs
from ..errors import RingflowError, ShutdownError
from ..messages import Handover, Heartbeat, Message, Plan, Submit, encode
from ..negotiation import CachedAllreduce, Coordinator, Request, Response
from .common import Wake

if TYPE_CHECKING:
    from . import Engine

__all__ = ["CoordinatorSeat"]

log = logging.getLogger(__package__)


class CoordinatorSeat:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.coord = 0  # the rank that coordinates
        self.coordinator: Coordinator | None = self._new() if engine.rank == 0 else None
        config = engine.config
        # Rank 0's autotuner (ringflow.autotune); dropped once it has chosen (or on a handover:
        # the values in force stay).
        self.tuner = Tuner(
            engine.params, allowed_compression=config.autotune_compression,
            fixed=fixed_knobs(), warmup_samples=config.autotune_warmup_samples,
            steps_per_sample=config.autotune_steps_per_sample,
            log_path=config.autotune_log_file,
        ) if engine.rank == 0 and engine.size > 1 and config.autotune else None
        self.early_submits: list[tuple[int, Submit]] = []  # before this rank took over
        # The coordinator stream: the seq of the next plan or handover to take in, those that
        # arrived ahead of it, and the goodbyes this rank saw while it did not coordinate (a
        # successor may hear of them before the departing coordinator did).
        self.stream = 0
        self.early_stream: dict[int, Plan | Handover] = {}
        self.departed: dict[int, str] = {}

    def _new(self) -> Coordinator:
        e = self.e
        return self._configure(Coordinator(e.size, e._members, e.config.fusion_threshold_bytes,
                                           e.cache))

    # the tunable values ------------------------------------------------------------------------
    def _configure(self, c: Coordinator) -> Coordinator:
        """What the coordinator applies of the values in force: the fusion threshold, and what
        its plan items carry (the wire compression, the chunk size)."""
        p = self.e.params
        c.fusion_threshold = p.fusion_threshold_bytes
        c.wire = "" if p.wire_compression == "none" else p.wire_compression
        c.chunk = p.chunk_bytes
        return c

    def set_params(self, params: Params) -> None:
        """New values (under the lock, in stream order): items planned from now on carry them,
        optimizers read them at their next backward pass."""
        self.e.params = params
        if self.coordinator is not None:
            self._configure(self.coordinator)

    def _tune(self, plan: list[Response | CachedAllreduce]) -> Params | None:
        """Rank 0: tell the autotuner what was planned; its new values, now in force here."""
        cache, names = self.e.cache, []
        for item in plan:
            if isinstance(item, CachedAllreduce):
                names += [(cache.key_of[b], cache.ref[b].nbytes) for b in item.bits]
            else:
                names += [(r.key, r.nbytes) for r in item.requests]
        params = self.tuner.planned(names)
        if self.tuner.done:
            self.tuner = None
        if params is not None:
            self.set_params(params)
        return params

    def stop_tuning(self) -> None:
        """The job ends (its log keeps what the tuner measured)."""
        tuner, self.tuner = self.tuner, None
        if tuner is not None:
            tuner.close()

    # requests ----------------------------------------------------------------------------------
    def submit(self, requests: list[Request], bits: list[int], data: list[Any]) -> None:
        """This rank's new requests and cache bits, to the coordinator."""
        e = self.e
        if self.coordinator is None:
            e._send(self.coord, Submit(requests, bits, data))
            return
        if e._timeline is not None:
            e._timeline.arrived(e.rank, requests, bits, e.cache)
        self.coordinator.submit(e.rank, requests, bits, data)
        self.plan()

    def on_submit(self, src: int, msg: Submit) -> None:
        """Another rank's submission, on its reader thread."""
        e = self.e
        if self.coordinator is None:  # sent to this rank as the successor before its Handover
            self.early_submits.append((src, msg))
            return
        if injection.ARMED:
            injection.hit("negotiate")
        if e._timeline is not None:
            e._timeline.arrived(src, msg.requests, msg.bits, e.cache)
        self.coordinator.submit(src, msg.requests, msg.bits, msg.data)
        self.plan()

    def plan(self) -> None:
        """The coordinator: turn what is ready into a plan, send it to every rank and take it in
        here."""
        e, c = self.e, self.coordinator
        holding = c.holding
        plan = c.plan(e.params.cycle_time_ms / 1000.0)
        if plan:
            if e._timeline is not None:
                e._timeline.negotiated(plan, e.cache)
            params = self._tune(plan) if self.tuner is not None else None
            seq = self.stream
            self.stream += 1
            self.broadcast(Plan(plan, seq, params))
            e.plans.receive(plan)
        elif c.holding and not holding:
            e._inbox.put((Wake.TICK,))  # the engine thread plans them when the window closes

    # the stream of plans and handovers --------------------------------------------------------
    def in_stream(self, msg: Plan | Handover) -> None:
        """Take in the coordinator stream in order: ``msg``, then whatever arrived early and
        follows it."""
        if msg.seq != self.stream:
            self.early_stream[msg.seq] = msg
            return
        while True:
            self.stream += 1
            if isinstance(msg, Plan):
                if msg.params is not None:
                    self.set_params(msg.params)
                self.e.plans.receive(msg.items)
            else:
                self._take_over(msg)
            if not self.early_stream:
                return
            msg = self.early_stream.pop(self.stream, None)
            if msg is None:
                return

    def _take_over(self, msg: Handover) -> None:
        """The coordinator left cleanly (after its last plan): follow its successor, and submit
        again in full what it never planned (the successor knows none of it)."""
        e = self.e
        self.coord = msg.successor
        e._liveness.follow(msg.successor, msg.gone)
        e.cache.mine.clear()  # the successor cannot decode other ranks' bits: full requests
        pending = list(e._submitted.values())
        if msg.successor != e.rank:
            if pending:
                e._send(msg.successor, Submit(pending, [], []))
            return
        c = self.coordinator = self._new()
        c.gone = {**self.departed, **msg.gone}
        c.joined, c.next_set_id = list(msg.joined), msg.next_set_id
        c.submit(e.rank, pending, [], [])
        early, self.early_submits = self.early_submits, []
        for src, sub in early:
            c.submit(src, sub.requests, sub.bits, sub.data)
        self.plan()

    def hand_over(self) -> None:
        """The coordinator leaves while other ranks may go on (process sets without it): the
        lowest rank still there coordinates from now on. Sent after this rank's last plan, so
        every rank has taken in every plan before it switches. Not under the lock."""
        e, c = self.e, self.coordinator
        if c is None or e.size == 1 or e.verdicts.fatal is not None:
            return
        gone = {**c.gone, e.rank: "it called shutdown()"}
        successor = next((r for r in range(e.size) if r not in gone), None)
        if successor is not None:
            with e._control():
                seq = self.stream
            self.broadcast(Handover(successor, gone, list(c.joined), c.next_set_id, seq))

    def on_goodbye(self, peer: int) -> None:
        """A peer shut down on purpose (the job goes on)."""
        if self.coordinator is not None:
            self.coordinator.rank_gone(peer, "it called shutdown()")
            self.plan()
        elif peer == self.coord:
            self.e._close(ShutdownError(f"rank {peer} (the coordinator) has shut down"))
        else:
            self.departed[peer] = "it called shutdown()"

    # messages ----------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        if self.coordinator is not None:
            self.broadcast(Heartbeat())
        else:
            self.e._send(self.coord, Heartbeat())

    def broadcast(self, msg: Message) -> None:
        """``msg`` to every other rank still there (the coordinator's messages)."""
        e = self.e
        if e.size == 1:
            return
        payload = encode(msg)
        gone = self.coordinator.gone if self.coordinator is not None else {}
        for dst in range(e.size):
            if dst == e.rank or dst in gone:
                continue
            try:
                e.transport.send_ctrl(payload, dst)
            except RingflowError as exc:
                log.debug("rank %d: could not send %s to %d: %s", e.rank, type(msg).__name__,
                          dst, exc)
