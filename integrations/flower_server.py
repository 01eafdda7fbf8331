"""Server side of the Flower plugin: a strategy wrapper that sizes each sampled client's work every round.

``LoadBalanced(strategy, history)`` wraps any message-API strategy (FedAvg, FedProx, FedAdam, ...). The
wrapped strategy still samples the clients and aggregates; around it, each round:

1. ``configure_train`` asks the wrapped strategy for its messages, then ``plan`` gives every sampled client
   a :class:`Workload` from the FL capacity model and :func:`lbbsp.allocate` (equal predicted finish,
   fixed total), and each message gets its *own* ConfigRecord (never one object shared by all clients).
2. ``aggregate_train`` partitions out failed and missing replies (logged, recorded as such, never raised),
   ``observe`` records the rest in Redis and teaches the model, and ``normalise`` sets each reply's weight to
   the samples it processed and, when step counts differ, applies the FedNova rescaling before the
   wrapped strategy aggregates.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Literal

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from lbbsp.allocation import LinearTime, RoundsOut, allocate_sitting_out, predicted_makespan, sit_out_share
from lbbsp.client_history import ClientHistory, ClientStatus
from lbbsp.errors import ConfigError, ProtocolError, StoreUnavailable
from lbbsp.fedagg import fednova_scales, rescale_update
from lbbsp.models import FLClientModel, NotFittedError
from lbbsp.protocol import Report, equal_split

from .flower_client import COMPUTE_S, DATA_SIZE, DOWNLOAD_S, MAX_LOCAL_STEPS, SAMPLES, STEPS, UPLOAD_S, Workload


@dataclass(frozen=True)
class ClientResult:
    """What a client says it did in one round, read from its reply metrics and validated."""

    samples: int
    steps: int
    compute_s: float
    download_s: float
    upload_s: float
    data_size: int | None = None

    @classmethod
    def from_metrics(cls, metrics: MetricRecord) -> ClientResult:
        values = {}
        for key in (SAMPLES, STEPS, COMPUTE_S, DOWNLOAD_S, UPLOAD_S, DATA_SIZE):
            value = metrics.get(key)
            if key == DATA_SIZE and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ProtocolError(f"must be a finite non-negative number, got {value!r}", field=key)
            values[key] = value
        if any(values[k] != int(values[k]) for k in (SAMPLES, STEPS, DATA_SIZE) if k in values):
            raise ProtocolError("samples, steps and data size must be whole numbers", field=SAMPLES)
        if values[STEPS] > MAX_LOCAL_STEPS:
            raise ProtocolError(f"must be at most {MAX_LOCAL_STEPS}", field=STEPS)
        data_size = int(values[DATA_SIZE]) if DATA_SIZE in values else None
        return cls(int(values[SAMPLES]), int(values[STEPS]), float(values[COMPUTE_S]), float(values[DOWNLOAD_S]),
                   float(values[UPLOAD_S]), data_size)

    def weight(self, weight_by: str) -> int:
        """This reply's aggregation weight: samples processed, or the client's data size."""
        if weight_by == "samples":
            return self.samples
        if self.data_size is None:
            raise ProtocolError("is missing: weight_by='data' needs the client's data size", field=DATA_SIZE)
        return self.data_size


@dataclass
class _Round:
    """What was sent in one round: the global arrays and each node's workload."""

    arrays: ArrayRecord
    plan: dict[int, Workload]
    workers: dict[int, int]


#: ``compensate_dropouts`` raises a round's total at most this many times.
MAX_COMPENSATION = 2
#: With ``sit_out``, clients sit a round out only if that makes it predicted this much (a fraction) shorter.
SIT_OUT_MIN_GAIN = 0.03


class LoadBalanced(Strategy):
    """LB-BSP for federated rounds: balance each sampled client's workload around a wrapped strategy.

    ``adapt="batch"`` (the paper's choice) keeps ``local_steps`` fixed and splits a round total of
    ``batch_size`` x clients samples per step; ``adapt="steps"`` keeps ``batch_size`` fixed and splits
    ``local_steps`` x clients steps, which FedNova normalisation keeps unbiased. ``deadline_slack`` (e.g.
    1.5) sends each client a compute deadline of that many times the predicted round time, minus its
    predicted transfer time, so a client that slows down stops early instead of holding the round.
    ``weight_by="samples"`` weights each reply by the samples it processed (every sample counts once);
    ``"data"`` by the client's data size (``LocalRound(data_size=...)``), the FedAvg objective on non-IID data.
    The model learns each client's availability from the round outcomes; the plan logs the share of the
    round total expected back. ``compensate_dropouts=True`` raises the total (at most ``MAX_COMPENSATION``
    times) so that the samples expected back make the nominal total: dropouts then cost time, not samples.
    ``sit_out`` (a share, e.g. 0.05) lets that many of the sampled clients, those predicted slowest even with
    the smallest workload, sit the round out when the others then finish sooner (by over
    ``SIT_OUT_MIN_GAIN``, 3%): they are not sent the
    round at all (no download), and the others share the round total. The same slow clients then tend to
    sit out round after round, so their data is trained on less: keep the share small. A client that sat out
    ``rejoin_after`` of the rounds it was sampled for in a row is asked in the next (None: no limit), which
    also renews its estimate. This count is kept in memory and starts again after a restart.
    """

    def __init__(self, strategy: Strategy, history: ClientHistory, *, batch_size: int = 32, local_steps: int = 1,
                 adapt: Literal["batch", "steps"] = "batch", min_size: int = 1, max_size: int | None = None,
                 deadline_slack: float | None = None, weight_by: Literal["samples", "data"] = "samples",
                 compensate_dropouts: bool = False, sit_out: float = 0.0, rejoin_after: int | None = 10,
                 model: FLClientModel | None = None) -> None:
        Workload(batch_size, local_steps)  # validates both
        if adapt not in ("batch", "steps"):
            raise ConfigError(f"adapt must be 'batch' or 'steps', got {adapt!r}")
        if weight_by not in ("samples", "data"):
            raise ConfigError(f"weight_by must be 'samples' or 'data', got {weight_by!r}")
        if min_size < 1 or (max_size is not None and max_size < min_size):
            raise ConfigError(f"need 1 <= min_size <= max_size, got {min_size} and {max_size}")
        if deadline_slack is not None and deadline_slack < 1:
            raise ConfigError(f"deadline_slack must be at least 1, got {deadline_slack}")
        self.strategy = strategy
        self.history = history
        self.batch_size = batch_size
        self.local_steps = local_steps
        self.adapt = adapt
        self.min_size = min_size
        self.max_size = max_size
        self.deadline_slack = deadline_slack
        self.weight_by = weight_by
        self.compensate_dropouts = compensate_dropouts
        self.sit_out = sit_out_share(sit_out)
        self.rounds_out = RoundsOut(rejoin_after)
        self.model = model if model is not None else FLClientModel(local_steps)
        self.weighted_by_key: str = getattr(strategy, "weighted_by_key", "num-examples")
        self.configrecord_key: str = getattr(strategy, "configrecord_key", "config")
        self._pending: dict[int, _Round] = {}
        stored = history.rounds()
        self._round_base = max((r.iteration for rounds in stored for r in rounds), default=0)
        if stored:
            self.model.fit(stored)
        last = history.statuses()  # each client's last outcome: a start for its availability after a restart
        if last:
            self.model.record_outcomes({worker: status.status == "ok" for worker, status in last.items()})

    def summary(self) -> None:
        log(INFO, "\t├──> LoadBalanced (lbbsp): adapt %s, batch size %d, local steps %d, deadline slack %s, "
                  "weight by %s, compensate dropouts %s, sit out %s (rejoin after %s), job %s", self.adapt,
            self.batch_size, self.local_steps, self.deadline_slack, self.weight_by, self.compensate_dropouts,
            self.sit_out, self.rounds_out.rejoin_after, self.history.job)
        self.strategy.summary()

    # -- training ----------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        plan = self.plan(server_round, [m.metadata.dst_node_id for m in messages])
        messages = [m for m in messages if m.metadata.dst_node_id in plan]  # the others sit this round out
        self._pending[server_round] = _Round(arrays, plan, {n: self.history.worker_index(n) for n in plan})
        for message in messages:
            self._personalise(message, plan[message.metadata.dst_node_id])
        return messages

    def plan(self, server_round: int, nodes: list[int]) -> dict[int, Workload]:
        """Each asked node's workload: equal predicted finish under the capacity model, round total fixed (or,
        with ``compensate_dropouts``, raised so that the samples expected back from the available clients make
        it). A node that sits the round out (``sit_out``) has no workload."""
        if not nodes:
            return {}
        unit = self.batch_size if self.adapt == "batch" else self.local_steps
        workers = [self.history.worker_index(n) for n in nodes]
        time_model = self._time_model(workers)
        available = self.model.availability(workers)
        total = unit * len(nodes)
        stay = self.rounds_out.due(workers)
        sizes, reason = self._split(time_model, total, stay)
        if self.compensate_dropouts and available @ sizes < total:
            sizes, reason = self._compensated(time_model, total, available, stay)
        reason += f"; {available @ sizes / total:.0%} of {total} expected back"
        self.rounds_out.record(workers, sizes)
        if not sizes.all():
            reason += f"; {int((sizes == 0).sum())} sit out"
        deadlines: list[float | None] = [None] * len(nodes)
        if self.deadline_slack is not None and time_model is not None:
            finish = self.deadline_slack * predicted_makespan(time_model, sizes)
            deadlines = [max(finish - float(t), 1e-3) for t in np.atleast_1d(time_model.overhead)]
        log(INFO, "lbbsp round %d: %s, sizes %s", server_round, reason, sizes.tolist())
        asked = [(n, int(s), d) for n, s, d in zip(nodes, sizes, deadlines) if s > 0]
        if self.adapt == "batch":
            return {n: Workload(s, self.local_steps, d) for n, s, d in asked}
        return {n: Workload(self.batch_size, s, d) for n, s, d in asked}

    def _compensated(self, time_model: LinearTime | None, total: int, available: np.ndarray,
                     stay: np.ndarray) -> tuple[np.ndarray, str]:
        """The split of the smallest total (at most ``MAX_COMPENSATION`` x ``total``) whose samples expected
        back reach ``total``: a bisection, since more in total never brings less back."""
        low, high = total, MAX_COMPENSATION * total
        while low < high:
            middle = (low + high) // 2
            if available @ self._split(time_model, middle, stay)[0] >= total:
                high = middle
            else:
                low = middle + 1
        return self._split(time_model, low, stay)

    def _split(self, time_model: LinearTime | None, total: int, stay: np.ndarray) -> tuple[np.ndarray, str]:
        """``total`` split over the clients for equal predicted finish, within the bounds; those in ``stay``
        do not sit out."""
        count = stay.size
        upper = min(self.max_size or total, total)
        if time_model is None or self.min_size * count > total or upper * count < total:
            reason = "equal split (no measurements yet)" if time_model is None else "equal split (bounds)"
            return np.array(equal_split(total, count)), reason
        sizes = allocate_sitting_out(time_model, total, [self.min_size] * count, [upper] * count, self.sit_out,
                                     SIT_OUT_MIN_GAIN, stay=stay)
        return sizes, f"predicted round {predicted_makespan(time_model, sizes):.3g}s"

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        sent = self._pending.pop(server_round, None)
        results = self.observe(server_round, replies, sent)
        if sent is not None:
            self.normalise(sent, replies, results)
        passed = [m for m in replies if m.has_error() or m.metadata.src_node_id in results]
        return self.strategy.aggregate_train(server_round, passed)

    def observe(self, server_round: int, replies: list[Message], sent: _Round | None) -> dict[int, ClientResult]:
        """Validate each reply's results, record every sampled client's outcome in Redis, teach the model."""
        results: dict[int, ClientResult] = {}
        outcomes: dict[int, ClientStatus] = {}
        workers = sent.workers if sent is not None else {}
        now = time.time()
        for message in replies:
            node = message.metadata.src_node_id
            worker = workers.get(node)
            reason = (message.error.reason or "error reply") if message.has_error() else ""
            if not reason:
                try:
                    metrics = next(iter(message.content.metric_records.values()), MetricRecord())
                    results[node] = ClientResult.from_metrics(metrics)
                except ProtocolError as exc:
                    reason = f"bad lbbsp metrics: {exc}"
            if reason:
                log(WARNING, "lbbsp round %d: node %d failed and is left out: %s", server_round, node, reason)
            if worker is not None:
                outcomes[worker] = ClientStatus(server_round, "failed" if reason else "ok", reason, now)
        for node in set(workers) - {m.metadata.src_node_id for m in replies}:
            log(WARNING, "lbbsp round %d: node %d sent no reply in time and is left out", server_round, node)
            outcomes[workers[node]] = ClientStatus(server_round, "missed", "no reply before the timeout", now)
        reports = []
        for node, result in results.items():
            if node not in workers:
                continue
            try:
                reports.append(Report(self.history.job, workers[node], self._round_base + server_round,
                                      result.samples, result.compute_s,
                                      features={"download_s": result.download_s, "upload_s": result.upload_s}))
            except ProtocolError as exc:
                log(WARNING, "lbbsp round %d: node %d's timings are not recorded: %s", server_round, node, exc)
        self.model.partial_fit(reports)
        self.model.record_outcomes({worker: outcome.status == "ok" for worker, outcome in outcomes.items()})
        try:
            self.history.record(reports, outcomes)
        except StoreUnavailable as exc:
            log(WARNING, "lbbsp round %d: history not saved, Redis unavailable: %s", server_round, exc)
        return results

    def normalise(self, sent: _Round, replies: list[Message], results: dict[int, ClientResult]) -> None:
        """Set each valid reply's weight (``weight_by``); rescale updates FedNova-style if steps differ.

        Replies without a single processed sample, or without the weight asked for, are dropped from
        ``results`` (logged).
        """
        weights = {}
        for node, result in list(results.items()):
            try:
                weights[node] = result.weight(self.weight_by)
            except ProtocolError as exc:
                log(WARNING, "lbbsp: node %d is left out of the aggregate: %s", node, exc)
            if result.samples == 0 or result.steps == 0 or weights.get(node, 0) == 0:
                del results[node]
        if not results:
            return
        nodes = list(results)
        scales = fednova_scales([results[n].steps for n in nodes], [weights[n] for n in nodes])
        by_node = {m.metadata.src_node_id: m for m in replies if not m.has_error()}
        global_arrays = list(sent.arrays.values())
        for node, scale in zip(nodes, scales):
            message = by_node[node]
            content = RecordDict(dict(message.content.items()))
            metrics = next(iter(content.metric_records.values()))
            metrics[self.weighted_by_key] = weights[node]
            if not np.isclose(scale, 1.0, rtol=1e-12, atol=0):
                key, local = next(iter(content.array_records.items()))
                rescaled = rescale_update([a.numpy() for a in global_arrays], [a.numpy() for a in local.values()],
                                          float(scale))
                content[key] = ArrayRecord({k: Array(v) for k, v in zip(local.keys(), rescaled)})
            message.content = content

    # -- evaluation: the wrapped strategy's own ----------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    # -- helpers -----------------------------------------------------------------------------------------
    def _time_model(self, workers: list[int]) -> LinearTime | None:
        """Round seconds as a function of each client's size (batch or steps); None before any measurement."""
        try:
            speed = self.model.predict(workers)
            transfer = self.model.transfer_s(workers)
        except NotFittedError:
            return None
        known = np.isfinite(speed) & (speed > 0)
        if not known.any():
            return None
        speed = np.where(known, speed, np.median(speed[known]))  # a new client: assume a typical one
        per_unit = self.local_steps if self.adapt == "batch" else self.batch_size
        return LinearTime(speed / per_unit, overhead=transfer, idle_is_free=True)  # a client not asked: no time

    def _personalise(self, message: Message, workload: Workload) -> None:
        """Give the message its own RecordDict and ConfigRecord (the arrays stay shared, read-only)."""
        content = RecordDict(dict(message.content.items()))
        base = message.content.config_records.get(self.configrecord_key, ConfigRecord())
        content[self.configrecord_key] = ConfigRecord({**dict(base), **workload.to_config()})
        message.content = content
