"""The compressed gradient exchange: PowerSGD, random-k and 1-bit with error feedback (issue 27).

An optimizer owns one :class:`Exchange` for its :class:`~ringflow.compression.GradientCompression`
options. For each batch of gradients the optimizer hands it (any bucketing: every tensor is its
own set of named operations, so ranks need not batch alike), :meth:`Exchange.start` compresses
and submits the first exchange, :meth:`Exchange.middle` waits for it and submits the second
(PowerSGD's Q, 1-bit's allgather), :meth:`Exchange.end` waits and writes the result into the
gradient in place. The optimizer calls ``middle`` on every batch before ``end`` on any, so the
second rounds of all batches are in flight together. The framework's arithmetic comes through
:class:`ArrayOps` (``HOST`` here for numpy; the torch adapter's runs on the tensor's device).

Notation, per tensor: ``g_w`` rank w's gradient, ``e_w`` its error feedback (zero at first),
``D_w = g_w + e_w``, ``c`` the factor of the reduce op (``prescale * postscale``, over ``n`` for
Average), ``R`` the result every rank gets. **Invariant** (each compressor's test): ``R = c * sum_w
(D_w - e_w')`` with ``e_w'`` the new error: what a rank did not send waits, exactly, in its error.

- **PowerSGD** (``M = D`` as a matrix, rows = first dimension): ``P_w = M_w Q`` (``Q`` the last
  step's averaged factor, or a random one from the shared seed), ``P = mean_w P_w`` (allreduce
  Average), ``P^ = orthonormal(P)`` (QR, the framework's, on the device), ``Q_w = M_w^T P^``,
  ``Q' = c * sum_w Q_w`` (allreduce), ``R = P^ Q'^T``, ``e_w' = M_w - P^ Q_w^T`` and the next
  step starts from ``Q'``. Bytes per rank and step: ``(rows + cols) * rank`` elements instead of
  ``rows * cols``, in two allreduces. Differs from torch's ``powerSGD_hook``: the error is what
  *this* rank's factor did not carry (``M_w - P^ Q_w^T``; torch keeps ``M_w - P^ Q'^T``, which
  holds the other ranks' data too: the sums over ranks are the same), it works on any number of
  buckets (torch's fails with a collective mismatch at two or more on gloo, issue 27), and there
  is no warm-up of uncompressed steps (``start_powerSGD_iter``; error feedback alone carries it).
- **random-k**: the indices ``I`` (``k = ceil(fraction * n)``, no repeats) come from a generator
  seeded with (seed, the tensor's name, its step count), the same on every rank; ``R[I] = c *
  sum_w D_w[I]`` (one allreduce of ``k`` values), ``R`` is 0 elsewhere; ``e_w' = D_w`` with
  ``I`` zeroed. No ``1/fraction`` rescaling: error feedback makes up for the rest.
- **1-bit**: ``D_w`` flattened is cut into ``n`` chunks (8-element aligned); rank w sends chunk j
  to rank j as ``s * sign`` with ``s = mean |chunk|`` (the scale that minimises the squared error;
  sign(0) = +1), in bits plus one float32 (alltoall); ``e_w' = D_w - sent``. Rank j sums its
  chunk ``A_j = c * sum_w sent_w,j``, adds its server error ``E_j``, sends ``B_j = A_j + E_j`` back
  the same way (allgather) and keeps ``E_j' = B_j - sent_j``. So ``R = c * sum_w (D_w - e_w') +
  E - E'`` (chunkwise): the invariant with the server's error added. Bytes per rank: about
  ``2 * n_elements / 8`` instead of the ring's ``2 * 4 * n_elements``.

The result differs from the exact allreduce by design. What bounds it (tested): the invariant
above; PowerSGD is exact when every rank's matrix has rank <= ``rank`` and the factors span it;
random-k with ``fraction=1`` and 1-bit at one rank of constant-magnitude values are exact. Every
rank gets the same result when its framework's QR gives the same bits for the same input (the
same library and thread count: the thread tier and processes of one host).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from . import runtime, submission
from .compression import Auto, GradientCompression, OneBit, PowerSGD, RandomK, parse
from .errors import ConfigError
from .ops import Average, ReduceOp, Sum
from .process_sets import ProcessSet, global_process_set
from .timeline import clock

__all__ = ["HOST", "ArrayOps", "Exchange", "auto_decision", "configured", "synced_state"]

log = logging.getLogger(__name__)

#: Probe of ``auto``: an allreduce this large, timed 3 times after a warm-up, the fastest kept.
#: At the 2 Gbit/s bound one takes about 8 ms, so a round trip's fraction of a millisecond on a
#: LAN shifts the measure by a few percent only (an estimate, not a measurement); at 100 Mbit/s
#: the probe costs about 0.7 s once.
PROBE_BYTES = 2 << 20


class ArrayOps(Protocol):
    """The framework arithmetic an :class:`Exchange` needs besides ``@ + - * reshape .T``."""

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` as a contiguous numpy array (a view where ``x`` is in host memory: read it)."""

    def from_host(self, a: np.ndarray, like: Any) -> Any:
        """``a`` as the framework's array on ``like``'s device (CPU where ``like`` is None)."""

    def write(self, x: Any, a: Any) -> None:
        """``x[...] = a`` in place (``a`` a numpy array or the framework's, same size)."""

    def orthonormal(self, p: Any) -> Any:
        """An orthonormal basis of ``p``'s columns (reduced QR's Q), on ``p``'s device."""


class _Host:
    """:class:`ArrayOps` on numpy arrays."""

    def to_host(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(x)

    def from_host(self, a: np.ndarray, like: Any) -> Any:
        return np.array(a, dtype=a.dtype if like is None else like.dtype)

    def write(self, x: Any, a: Any) -> None:
        x[...] = np.reshape(a, x.shape)

    def orthonormal(self, p: Any) -> Any:
        return np.linalg.qr(p)[0]


HOST = _Host()


def configured(compression: Any) -> Any:
    """An optimizer's ``compression=``, or ``RINGFLOW_COMPRESSION``'s (``ringflow-run
    --compression``) where the call left the default ``Compression.none``."""
    if getattr(compression, "name", None) == "none" and not isinstance(compression,
                                                                        GradientCompression):
        text = runtime.running().config.compression
        if text != "none":
            return parse(text)
    return compression


def auto_decision(one_host: bool, busbw_gbit: float | None, below_gbit: float) -> bool:
    """Whether ``auto`` compresses: never on one host (shared memory moves gradients faster
    than any compressor encodes them), else when the measured bus bandwidth is below the bound."""
    return not one_host and busbw_gbit is not None and busbw_gbit < below_gbit


@dataclasses.dataclass
class _Item:
    """One tensor in flight: its compressor's working values between the phases."""

    name: str
    tensor: Any
    values: dict[str, Any]
    handle: Any = None
    times: list[float] = dataclasses.field(default_factory=list)  # timeline: phase boundaries


class Exchange:
    """The state of one compressor for one optimizer: error feedback, PowerSGD's warm start,
    random-k's step counts, 1-bit's server errors, all keyed by tensor name.

    ``op`` (Average or Sum) and the scales are the optimizer's; ``process_set`` is where the
    gradients are reduced. Raises ConfigError for other reduce ops.
    """

    def __init__(self, options: GradientCompression, ops: ArrayOps = HOST,
                 op: ReduceOp = Average, prescale: float = 1.0, postscale: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> None:
        if ReduceOp(op) not in (Average, Sum):
            raise ConfigError(f"compression {options.spec()} needs op=Average or op=Sum, got "
                              f"{ReduceOp(op).name}; use Compression.none for other ops")
        self.options = options
        self.ops = ops
        self.op = ReduceOp(op)
        self.prescale, self.postscale = float(prescale), float(postscale)
        self.process_set = process_set
        self.kind = options.inner if isinstance(options, Auto) else options
        self.clear()

    def clear(self) -> None:
        """Forget every tensor's state (as a new exchange)."""
        #: None until ``auto`` has decided; then whether it compresses.
        self.active: bool | None = None if isinstance(self.options, Auto) else True
        self.errors: dict[str, Any] = {}  # name -> e_w (PowerSGD: the framework's, else numpy)
        self.factors: dict[str, Any] = {}  # PowerSGD: name -> Q' (the framework's)
        self.steps: dict[str, int] = {}  # random-k: name -> exchanges so far
        self.server: dict[str, np.ndarray] = {}  # 1-bit: name -> E_j of this rank's chunk

    # which tensors --------------------------------------------------------------------------------
    def compresses(self, tensor: Any, dtype: str) -> bool:
        """Whether ``tensor`` (of numpy dtype name ``dtype``) goes compressed; the first call of
        ``auto`` measures the link (a collective: every member calls it at its first tensor)."""
        if self.active is None:
            self.active = self._decide()
        if not self.active or dtype not in ("float32", "float64"):
            return False
        shape = tuple(tensor.shape)
        if None in shape:  # a graph's tensor of unknown size: exact
            return False
        numel = math.prod(shape)
        if numel < self.kind.min_elements:  # auto: its inner compressor's
            return False
        if isinstance(self.kind, PowerSGD):
            rows = shape[0] if len(shape) > 1 else 1
            cols = numel // max(rows, 1)
            r = min(self.kind.rank, rows, cols)
            return len(shape) > 1 and r * (rows + cols) < numel
        return True

    def _decide(self) -> bool:
        options = cast(Auto, self.options)  # only auto decides
        one_host = runtime.cross_size() == 1
        busbw = None if one_host else self._probe()
        on = auto_decision(one_host, busbw, options.below_gbit)
        log.info("compression auto: %s (%s)", self.kind.spec() if on else "off",
                 "one host" if one_host else f"bus bandwidth {busbw:.2f} Gbit/s, compressing "
                 f"below {options.below_gbit} Gbit/s")
        return on

    def _probe(self) -> float:
        n = self.process_set.size()
        data = np.ones(PROBE_BYTES // 4, np.float32)
        best = math.inf
        for i in range(4):  # the first one warms the connections up
            t0 = time.perf_counter()
            submission.submit_fields("allreduce", data, f"ringflow.auto_probe.{i}",
                                     self.process_set, None, submission.scales(Sum, 1, 1)).wait()
            if i:
                best = min(best, time.perf_counter() - t0)
        slowest = submission.submit_fields(
            "allreduce", np.array([best]), "ringflow.auto_probe.max", self.process_set, None,
            submission.scales(ReduceOp.MAX, 1, 1)).wait()
        return 2 * (n - 1) / max(n, 1) * PROBE_BYTES * 8 / float(slowest[0]) / 1e9

    # the three phases -----------------------------------------------------------------------------
    def start(self, names: Sequence[str], tensors: Sequence[Any]) -> list[_Item]:
        """Compress ``tensors`` (with their error feedback) and submit the first exchange."""
        items = [_Item(n, t, {}, times=[clock()]) for n, t in zip(names, tensors, strict=True)]
        if not items:
            return items
        if isinstance(self.kind, PowerSGD):
            arrays = [self._powersgd_p(it) for it in items]
            self._allreduce(items, arrays, "powersgd.p", Average, 1.0, 1.0)
        elif isinstance(self.kind, RandomK):
            arrays = [self._randomk_values(it) for it in items]
            self._allreduce(items, arrays, "randomk", self.op, self.prescale, self.postscale)
        else:
            n = self.process_set.size()
            for it in items:
                rows = self._onebit_worker(it, n)
                it.handle = submission.submit("alltoall", rows, f"{it.name}.onebit.1",
                                              self.process_set, splits=(1,) * n)
        sent = clock()
        for it in items:
            it.times.append(sent)
        return items

    def middle(self, items: Sequence[_Item]) -> None:
        """Wait for the first exchange; submit the second (PowerSGD, 1-bit)."""
        if isinstance(self.kind, PowerSGD):
            arrays = [self._powersgd_q(it) for it in items]
            self._allreduce(items, arrays, "powersgd.q", self.op, self.prescale, self.postscale)
        elif isinstance(self.kind, OneBit):
            for it in items:
                row = self._onebit_server(it)
                it.handle = submission.submit("allgather", row, f"{it.name}.onebit.2",
                                              self.process_set)

    def end(self, items: Sequence[_Item]) -> None:
        """Wait for the last exchange and write each result into its tensor."""
        engine = runtime.running()
        for it in items:
            received = it.handle.wait()
            it.times.append(clock())
            if isinstance(self.kind, PowerSGD):
                self._powersgd_end(it, received)
            elif isinstance(self.kind, RandomK):
                out = np.zeros(it.values["numel"], received.dtype)
                out[it.values["index"]] = received
                self.ops.write(it.tensor, out)
            else:
                flat = _decode(received, it.values["chunk"]).reshape(-1)[:it.values["numel"]]
                self.ops.write(it.tensor, flat.astype(it.values["dtype"], copy=False))
            it.times.append(clock())
            for label, t0, t1 in zip(("COMPRESS", "EXCHANGE", "DECOMPRESS"), it.times,
                                     it.times[1:], strict=False):
                engine.record_span(it.name, label, t0, t1)

    def _allreduce(self, items: Sequence[_Item], arrays: list[np.ndarray], what: str,
                   op: ReduceOp, pre: float, post: float) -> None:
        handles = submission.submit_many(
            "allreduce", arrays, [f"{it.name}.{what}" for it in items], self.process_set, None,
            {**submission.scales(op, pre, post), "compression": "none"})
        for it, handle in zip(items, handles, strict=True):
            it.handle = handle

    # PowerSGD ---------------------------------------------------------------------------------
    def _powersgd_p(self, it: _Item) -> np.ndarray:
        x = it.tensor
        m = x.reshape(x.shape[0], -1)
        e = self.errors.get(it.name)
        m = m * 1 if e is None else m + e  # a copy: the result is written into x
        q = self.factors.get(it.name)
        kind = cast(PowerSGD, self.kind)
        r = min(kind.rank, *m.shape)
        if q is None or tuple(q.shape) != (m.shape[1], r):
            seed = [kind.seed, zlib.crc32(it.name.encode())]
            q = self.ops.from_host(np.random.default_rng(seed).standard_normal((m.shape[1], r)), m)
        it.values["m"] = m
        return self.ops.to_host(m @ q)

    def _powersgd_q(self, it: _Item) -> np.ndarray:
        m = it.values["m"]
        p = self.ops.orthonormal(self.ops.from_host(it.handle.wait(), m))
        q_own = m.T @ p
        it.values["p"], it.values["q_own"] = p, q_own
        return self.ops.to_host(q_own)

    def _powersgd_end(self, it: _Item, received: np.ndarray) -> None:
        m, p, q_own = it.values["m"], it.values["p"], it.values["q_own"]
        q = self.ops.from_host(received, m)
        self.errors[it.name] = m - p @ q_own.T
        self.factors[it.name] = q
        self.ops.write(it.tensor, p @ q.T)

    # random-k ---------------------------------------------------------------------------------
    def _randomk_values(self, it: _Item) -> np.ndarray:
        d = self.ops.to_host(it.tensor).reshape(-1).copy()
        e = self.errors.get(it.name)
        if e is not None:
            d += e
        step = self.steps.get(it.name, 0)
        self.steps[it.name] = step + 1
        kind = cast(RandomK, self.kind)
        k = math.ceil(kind.fraction * d.size)
        rng = np.random.default_rng([kind.seed, zlib.crc32(it.name.encode()), step])
        index = np.sort(rng.choice(d.size, k, replace=False, shuffle=False))
        values = d[index]
        d[index] = 0
        self.errors[it.name] = d
        it.values.update(index=index, numel=d.size)
        return values

    # 1-bit ------------------------------------------------------------------------------------
    def _onebit_worker(self, it: _Item, n: int) -> np.ndarray:
        d = self.ops.to_host(it.tensor).reshape(-1)
        e = self.errors.get(it.name)
        d = d + e if e is not None else d.copy()
        chunk = _chunk_len(d.size, n)
        padded = np.zeros(n * chunk, d.dtype)
        padded[:d.size] = d
        valid = _valid(d.size, n, chunk)
        rows, sent = _encode(padded.reshape(n, chunk), valid)
        self.errors[it.name] = d - sent.reshape(-1)[:d.size]
        it.values.update(chunk=chunk, numel=d.size, dtype=d.dtype, valid=valid)
        return rows

    def _onebit_server(self, it: _Item) -> np.ndarray:
        rows, _ = it.handle.wait()
        chunk, dtype = it.values["chunk"], it.values["dtype"]
        n = self.process_set.size()
        c = self.prescale * self.postscale / (n if self.op == Average else 1)
        valid = it.values["valid"][self.process_set.rank():][:1]
        b = (_decode(rows, chunk).astype(dtype).sum(axis=0) * c).astype(dtype)
        b[valid[0]:] = 0  # padding decodes as +-scale
        server = self.server.get(it.name)
        if server is not None and server.shape == b.shape:
            b += server
        row, sent = _encode(b.reshape(1, chunk), valid)
        self.server[it.name] = b - sent.reshape(-1)
        return row

    # state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (numpy arrays become the framework's, on the CPU)."""
        def export(values: dict[str, Any]) -> dict[str, Any]:
            return {k: self.ops.from_host(v, None) if isinstance(v, np.ndarray) else v
                    for k, v in values.items()}

        return {"compression": self.options.spec(), "active": self.active,
                "errors": export(self.errors), "factors": export(self.factors),
                "steps": dict(self.steps), "server": export(self.server)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises:
            ConfigError: the state is another compressor's (its kind or options differ).
        """
        if state.get("compression") != self.options.spec():
            raise ConfigError(
                f"the checkpoint holds the state of compression {state.get('compression')!r}, "
                f"this optimizer compresses with {self.options.spec()!r}; load it into an "
                "optimizer with the same compression, or drop its 'ringflow_compression' entry")
        framework = isinstance(self.kind, PowerSGD)

        def imported(values: dict[str, Any]) -> dict[str, Any]:
            return {k: v if framework else np.array(self.ops.to_host(v)) for k, v in values.items()}

        self.active = state["active"]
        self.errors = imported(state["errors"])
        self.factors = dict(state["factors"])
        self.steps = dict(state["steps"])
        self.server = {k: np.array(self.ops.to_host(v)) for k, v in state["server"].items()}


def synced_state(received: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The compressor's state after an elastic reset's sync (:meth:`Exchange.state_dict`'s form):
    what must be equal on every rank from rank 0 (``received``: the auto decision, PowerSGD's
    warm-start factors, random-k's step counts, which seed its shared choice), and this rank's
    ``own`` error feedback (a survivor's restored residuals; a newcomer's empty ones), since a
    residual is what this rank did not send. 1-bit's per-chunk server residuals start afresh:
    the chunks are cut by the world's size."""
    return {**received, "errors": own["errors"], "server": {}}


def _chunk_len(numel: int, n: int) -> int:
    """Elements of each of the ``n`` chunks of 1-bit: at least ``numel / n``, a multiple of 8."""
    return max(8, -(-numel // n) + 7) // 8 * 8


def _valid(numel: int, n: int, chunk: int) -> np.ndarray:
    """How many elements of each chunk are the tensor's (the rest is padding)."""
    return np.clip(numel - np.arange(n) * chunk, 0, chunk)


def _encode(chunks: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``[float32 scale | sign bits]`` for each chunk, and the values they stand for
    (padding: 0). The scale is the mean magnitude of the chunk's own elements; the padding, at
    the end of the flat buffer, holds zeros (it adds nothing to the magnitude)."""
    n, chunk = chunks.shape
    scale = (np.abs(chunks).sum(axis=1) / np.maximum(valid, 1)).astype(np.float32)
    positive = chunks >= 0
    s = scale.astype(chunks.dtype)[:, None]
    sent = np.where(positive, s, -s)  # one pass (a product of +-1 and the scale took 3x)
    sent.reshape(-1)[int(valid.sum()):] = 0
    rows = np.empty((n, 4 + chunk // 8), np.uint8)
    rows[:, :4] = scale.reshape(n, 1).view(np.uint8)
    rows[:, 4:] = np.packbits(positive, axis=1)
    return rows, sent


def _decode(rows: np.ndarray, chunk: int) -> np.ndarray:
    """The values rows of :func:`_encode` stand for, padding included (float32)."""
    scale = np.ascontiguousarray(rows[:, :4]).view(np.float32).reshape(-1, 1)
    positive = np.unpackbits(rows[:, 4:], axis=1, count=chunk).view(bool)
    return np.where(positive, scale, -scale)
