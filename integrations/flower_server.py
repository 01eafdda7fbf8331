"""Server side of the Flower plugin: a strategy wrapper that sizes each sampled client's work every round.

``LoadBalanced(strategy, history)`` wraps any message-API strategy (FedAvg, FedProx, FedAdam, ...). The
wrapped strategy still samples the clients and aggregates; around it, each round:

1. ``configure_train`` asks the wrapped strategy for its messages (with ``ask_hardware_s``, first asks each new
   node for its hardware with a query message), then ``plan`` gives every sampled client
   a :class:`Workload` from the FL capacity model and :func:`lbbsp.allocate` (equal predicted finish,
   fixed total), and each message gets its *own* ConfigRecord (never one object shared by all clients) and is
   stamped as created once planned (a client's MessageClock counts none of the plan's wait for Redis).
2. ``aggregate_train`` partitions out failed and missing replies (logged, recorded as such, never raised),
   and those that claim more work than they were sent or return arrays unlike the model's (which would
   otherwise carry their claimed weight or FedNova scale); ``observe`` records the rest in Redis and teaches
   the model, and ``normalise`` sets each reply's weight (``weight_by``) and, when step counts differ, applies
   the FedNova rescaling; lbbsp's own ``lbbsp-*`` metrics and hardware record are then removed and the wrapped strategy
   aggregates. A reply without lbbsp's metrics (a plain Flower ClientApp) is aggregated as it is: it teaches
   the capacity model nothing.
"""
from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from numbers import Integral, Real
from typing import Literal

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    FedXgbBagging,
    FedXgbCyclic,
    Strategy,
)

from lbbsp.allocation import (
    LinearTime,
    RoundsOut,
    allocate_sitting_out,
    damp,
    predicted_makespan,
    sit_out_share,
)
from lbbsp.client_history import ClientHistory, ClientStatus
from lbbsp.dropouts import dropout_bounds, weighed_dropout
from lbbsp.errors import ConfigError, ProtocolError, StoreUnavailable, printable
from lbbsp.fedagg import fednova_scales, rescale_update
from lbbsp.models import FLClientModel, NotFittedError, hardware_of
from lbbsp.protocol import MAX_BATCH, MAX_REASON_CHARS, MAX_SECONDS, MAX_WORKERS, Report, _flag, equal_split

from .flower_client import (
    COMPUTE_S,
    DATA_SIZE,
    DOWNLOAD_S,
    HARDWARE,
    LBBSP_PREFIX,
    MAX_LOCAL_STEPS,
    SAMPLES,
    STEPS,
    UPLOAD_S,
    ClientHardware,
    Workload,
)
from .flower_local import LocalGrid, strategy_attribute, wrapped_chain

#: The reply metrics a LocalRound always sends; a reply with none of them is a plain Flower reply.
TIMINGS = (SAMPLES, STEPS, COMPUTE_S, DOWNLOAD_S, UPLOAD_S)
#: The reply metric behind each Report field a reply fills: a value the Report refuses is named as the client sent it.
REPORT_METRICS = {"samples": SAMPLES, "compute_s": COMPUTE_S, "features.download_s": DOWNLOAD_S,
                  "features.upload_s": UPLOAD_S}


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
        """Read a reply's ``lbbsp-*`` metrics; a :class:`ProtocolError` naming the metric that is missing, negative,
        not finite, or a fraction where a count belongs."""
        values = {}
        for key in (SAMPLES, STEPS, COMPUTE_S, DOWNLOAD_S, UPLOAD_S, DATA_SIZE):
            value = metrics.get(key)
            if key == DATA_SIZE and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value < 0:
                raise ProtocolError(f"must be a finite non-negative number, got {value!r:.40}", field=key)
            values[key] = value
        # counts under 2**63, as an int metric is: two clients' data sizes of 1e308 had summed past a float in the
        # FedNova weights, and the ServerApp stopped
        for key in (SAMPLES, STEPS, DATA_SIZE):
            if key in values and (values[key] != int(values[key]) or values[key] >= 2**63):
                raise ProtocolError(f"must be a whole number under 2**63, got {values[key]!r}", field=key)
        if values[STEPS] > MAX_LOCAL_STEPS:
            raise ProtocolError(f"must be at most {MAX_LOCAL_STEPS}", field=STEPS)
        data_size = int(values[DATA_SIZE]) if DATA_SIZE in values else None
        return cls(int(values[SAMPLES]), int(values[STEPS]), float(values[COMPUTE_S]), float(values[DOWNLOAD_S]),
                   float(values[UPLOAD_S]), data_size)

    def check(self, workload: Workload) -> ClientResult:
        """Raise a ProtocolError unless this is work the client was given: at most its local steps (a deadline
        may stop it sooner), each of its batch size, only the last one allowed short. A reply may claim no more:
        its steps scale its update (FedNova) and its samples may be its weight."""
        if self.steps > workload.local_steps:
            raise ProtocolError(f"{self.steps} steps claimed, {workload.local_steps} assigned", field=STEPS)
        most = self.steps * workload.batch_size
        if not most - workload.batch_size < self.samples <= most:
            raise ProtocolError(f"{self.samples} in {self.steps} steps of batch size {workload.batch_size}: must be "
                                f"more than {most - workload.batch_size} and at most {most}", field=SAMPLES)
        return self

    def weight(self, weight_by: str) -> int:
        """This reply's aggregation weight: the client's data size (``weight_by`` "auto" or "data") when it
        reported one, else the samples it processed."""
        if weight_by != "samples" and self.data_size is not None:
            return self.data_size
        return self.samples


def _finite(value: int | float) -> bool:
    """Whether a metric is a finite float or an int under 2**63 (a MetricRecord built in process may hold a
    larger one, which numpy's isfinite and float() refuse)."""
    return math.isfinite(value) if isinstance(value, float) else abs(value) < 2**63


def has_timings(metrics: MetricRecord) -> bool:
    """Whether a reply's metrics come from a :class:`LocalRound` (any of lbbsp's timings), not a plain ClientApp."""
    return any(key in metrics for key in TIMINGS)


@dataclass
class _Round:
    """What was sent in one round: the global arrays and each node's workload."""

    arrays: ArrayRecord
    plan: dict[int, Workload]
    workers: dict[int, int]
    predicted_s: float | None  # the round's predicted seconds; None before any measurement
    started: float  # time.monotonic() when the messages were handed to Flower
    messages: list[Message]  # as handed to Flower, whose grid gives each its message id as it sends it

    @functools.cached_property
    def layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Each global array's shape and dtype as its bytes decode, once a round: the check of every reply had
        decoded the whole model again."""
        return {name: (decoded.shape, decoded.dtype) for name, decoded in
                ((name, array.numpy()) for name, array in self.arrays.items())}


#: The most characters of a client's error reason that are logged, stored and passed on, once escaped: room for
#: lbbsp's own client errors whole, whose fix comes last (at 200, "... pass yours there and leave these keys out" was
#: cut off), within what a client's stored status keeps (:data:`lbbsp.protocol.MAX_REASON_CHARS`).
MAX_CLIENT_REASON_CHARS = 500
#: What Flower's legacy client adapter fails with when a Message API strategy's train message reaches it.
LEGACY_CLIENT = "'fitins.parameters'"
#: ``compensate_dropouts`` raises a round's total at most this many times.
MAX_COMPENSATION = 2
#: After its bisection, ``compensate_dropouts`` tries this many totals below the one found: the samples expected back
#: are not monotone in the total (``LoadBalanced._compensated``), and a smaller total that suffices is mostly close.
COMPENSATION_SCAN = 8
#: A data size over this many times the client's previous one, or the median of the round's others, is warned about.
DATA_SIZE_LEAP = 100
#: The split moves work between clients (or lets them sit out) only if that makes the round predicted this much
#: (a fraction) shorter than the equal split: where transfers or fixed overheads set the round, moving samples
#: buys no time and would only skew who trains on how much.
MIN_GAIN = 0.03


class LoadBalanced(Strategy):
    """LB-BSP for federated rounds: balance each sampled client's workload around a wrapped strategy.

    ``adapt="batch"`` (the paper's choice) keeps ``local_steps`` fixed and splits a round total of
    ``batch_size`` x clients samples per step; ``adapt="steps"`` keeps ``batch_size`` fixed and splits
    ``local_steps`` x clients steps, which FedNova normalisation keeps unbiased. ``min_size``/``max_size``
    bound the adapted size, so they must hold its mean (``batch_size``, or ``local_steps``).
    ``deadline_slack`` (e.g. 1.5) sends each client a compute deadline of that many times the predicted
    round time, minus its predicted transfer time, so a client that slows down stops early instead of
    holding the round.
    ``weight_by="auto"`` (the default) weights each reply by the client's data size when it reports one
    (``LocalRound(data_size=...)``): FedAvg's objective, which non-IID data needs; a reply without it is
    weighted by the samples it processed. ``"data"`` does the same but warns about each client that reports
    no data size; ``"samples"`` always weights by samples processed (every sample counts once, unbiased on
    IID data only).
    A data size cannot be checked: one over ``DATA_SIZE_LEAP`` (100) times the client's previous one in this run, or
    the median of the round's other clients, is warned about, once a client, and still weighs what it claims.
    The model learns each client's availability from the round outcomes; the plan logs the share of the
    round total expected back, and caps the largest workloads where a client's absence would cost more than the
    later finish does (:func:`lbbsp.dropouts.dropout_bounds`). ``compensate_dropouts=True`` raises the total (at
    most ``MAX_COMPENSATION`` times, and within ``max_size``) so that the samples expected back make the nominal
    total: dropouts then cost time, not samples.
    ``sit_out`` (a share, e.g. 0.05) lets that many of the sampled clients, those predicted slowest even with
    the smallest workload, sit the round out when the others then finish sooner (by over
    ``MIN_GAIN``, 3%): they are not sent the
    round at all (no download), and the others share the round total. The same slow clients then tend to
    sit out round after round, so their data is trained on less: keep the share small. A client that sat out
    ``rejoin_after`` of the rounds it was sampled for in a row is asked in the next (None: no limit), which
    also renews its estimate. This count is kept in memory and starts again after a restart.
    Each reply carries the client's hardware (:class:`ClientHardware`), and a client not measured yet is planned at
    the speed of clients with the same device and cores. ``ask_hardware_s`` (seconds) asks a node whose hardware is
    not known yet for it before its first round, with a query message (its ClientApp answers with
    :func:`hardware_reply`), waiting at most that long (allow for a ClientApp's start-up: a query is a message): its
    first workload is then sized like its peers'. None (the default) asks nothing, and a new client's first round is
    planned at the median of all clients.
    """

    def __init__(self, strategy: Strategy, history: ClientHistory, *, batch_size: int = 32, local_steps: int = 1,
                 adapt: Literal["batch", "steps"] = "batch", min_size: int = 1, max_size: int | None = None,
                 deadline_slack: float | None = None, weight_by: Literal["auto", "samples", "data"] = "auto",
                 compensate_dropouts: bool = False, sit_out: float = 0.0, rejoin_after: int | None = 10,
                 model: FLClientModel | None = None, ask_hardware_s: float | None = None) -> None:
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"strategy must be a Flower message-API strategy instance, e.g. "
                              f"flwr.serverapp.strategy.FedAvg(...), got {strategy!r}{_why_not(strategy)}")
        if isinstance(strategy, LoadBalanced):  # the outer one had planned equal splits for good, blaming the clients
            raise ConfigError("strategy is a LoadBalanced already: wrap the Flower strategy itself once, "
                              "LoadBalanced(FedAvg(...), history, ...)")
        chain = list(wrapped_chain(strategy))
        if any(isinstance(s, (FedXgbBagging, FedXgbCyclic)) for s in chain):
            raise ConfigError("LoadBalanced balances the samples of each client's local SGD steps, and Flower's "
                              "FedXgbBagging and FedXgbCyclic train trees, with neither batches nor steps: run them "
                              "without LoadBalanced")
        client_clipped = [type(s).__name__ for s in chain if isinstance(
            s, (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyClientSideAdaptiveClipping))]
        self._client_clipped = bool(client_clipped)  # normalise never stretches an update the client clipped
        if client_clipped and (adapt == "steps" or deadline_slack is not None):
            raise ConfigError(f"{client_clipped[0]} has each client clip its update, and LoadBalanced rescales the "
                              f"updates FedNova-style where clients take different numbers of steps "
                              f"(adapt='steps', or a deadline_slack that stops a client early): an update of fewer "
                              f"steps than the mean is stretched past the clipping norm, which the noise no longer "
                              f"covers. Use adapt='batch' without deadline_slack (every client takes local_steps), or "
                              f"a server-side DP wrapper inside LoadBalanced, which clips after the rescaling")
        if strategy_attribute(strategy, "accountant", None) is not None and (weight_by == "samples" or sit_out):
            raise ConfigError("the DP wrapper's accountant needs equal client weights and every client sampled to "
                              "reply (Flower's accounted aggregation refuses others), and LoadBalanced weights each "
                              "update by the samples its client trained with weight_by='samples', which the balanced "
                              "split makes unequal, and sit_out leaves clients out: use weight_by='data' with equal "
                              "data sizes and no sit_out, or the DP wrapper without an accountant")
        if not isinstance(history, ClientHistory):
            raise ConfigError(f"history must be a ClientHistory, e.g. ClientHistory.from_url(url, job), "
                              f"got {history!r}")
        Workload(batch_size, local_steps)  # validates both, and that one client's round fits a Report
        if adapt not in ("batch", "steps"):
            raise ConfigError(f"adapt must be 'batch' or 'steps', got {adapt!r}")
        if weight_by not in ("auto", "samples", "data"):
            raise ConfigError(f"weight_by must be 'auto', 'samples' or 'data', got {weight_by!r}")
        unit_name, unit = ("batch_size", batch_size) if adapt == "batch" else ("local_steps", local_steps)
        lowest = _whole("min_size", min_size)
        highest = None if max_size is None else _whole("max_size", max_size)
        if lowest > unit or (highest is not None and highest < unit):
            raise ConfigError(f"with adapt={adapt!r} min_size and max_size bound the {unit_name}, so they must "
                              f"hold its mean: need min_size <= {unit_name} <= max_size, got min_size "
                              f"{min_size!r}, {unit_name} {unit}, max_size {max_size!r}")
        if deadline_slack is not None and (isinstance(deadline_slack, bool) or not isinstance(deadline_slack, Real)
                                           or not math.isfinite(deadline_slack) or deadline_slack < 1):
            raise ConfigError(f"deadline_slack must be None or a finite number of at least 1, got {deadline_slack!r}")
        compensate_dropouts = _flag(compensate_dropouts, "compensate_dropouts")
        if ask_hardware_s is not None and (isinstance(ask_hardware_s, bool) or not isinstance(ask_hardware_s, Real)
                                           or not 0 < ask_hardware_s <= MAX_SECONDS):
            raise ConfigError(f"ask_hardware_s must be None or seconds in (0, {MAX_SECONDS:g}], got {ask_hardware_s!r}")
        self.strategy = strategy
        self.history = history
        self.batch_size = batch_size
        self.local_steps = local_steps
        self.adapt = adapt
        self.min_size = lowest
        self.max_size = highest
        self.deadline_slack = None if deadline_slack is None else float(deadline_slack)
        self.weight_by = weight_by
        self.compensate_dropouts = compensate_dropouts
        self.sit_out = sit_out_share(sit_out)
        self.rounds_out = RoundsOut(rejoin_after)
        if model is not None and not isinstance(model, FLClientModel):
            raise ConfigError(f"model must be an FLClientModel (lbbsp.models): the plan needs each client's transfer "
                              f"time and availability, which only it learns; got {model!r}")
        self.model = model or FLClientModel(local_steps)
        self.ask_hardware_s = None if ask_hardware_s is None else float(ask_hardware_s)
        self._asked_hardware: set[int] = set()  # nodes asked for their hardware in this run
        self._announced: dict[int, ClientHardware] = {}  # node -> hardware it answered, until plan() teaches the model
        self._said: dict[int, tuple[str, int]] = {}  # worker -> the hardware key it answered, until it is measured
        self.weighted_by_key: str = strategy_attribute(strategy, "weighted_by_key", "num-examples")
        self.configrecord_key: str = strategy_attribute(strategy, "configrecord_key", "config")
        self._pending: dict[int, _Round] = {}
        self._temporary: dict[int, int] = {}  # node -> worker index while Redis cannot give it one
        self._next_temporary = MAX_WORKERS - 1  # temporary indices count down from the top: no stored one clashes
        self._told: set[tuple[str, int]] = set()  # (what, node) already logged once
        self._data_sizes: dict[int, int] = {}  # node -> the data size of its last measured reply in this run
        self._told_sit_out = False
        self._planned_indices: dict[int, int] = {}  # node -> worker index, as the latest plan() looked them up
        try:
            history.check_access()  # a Redis Cluster, or a user without scripting: refused now, not at round 1
            stored = history.rounds()
            last = history.statuses()  # each client's last outcome: a start for its availability after a restart
        except StoreUnavailable as exc:  # not an outage to ride out, as in a round: nothing has started yet
            raise StoreUnavailable(f"LoadBalanced loads the stored client history when it is built, so Redis must "
                                   f"answer then: check the URL and that redis-server runs there (or use "
                                   f"EmbeddedRedis().url). {exc.message}", job=history.job) from exc
        self._round_base = max([r.iteration for rounds in stored for r in rounds] +
                               [status.round for status in last.values()], default=0)
        self._last_iteration = self._round_base  # the highest round recorded: a second start() carries on from it
        if stored:
            self.model.fit(stored)
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
        if server_round == 1:  # a run starts (again): its rounds follow every round recorded before
            self._round_base = self._last_iteration
        for skipped in sorted(self._pending):  # Flower aggregates a round before it configures the next
            log(WARNING, "lbbsp round %d: no replies reached LoadBalanced (a strategy wrapped around it, such as a DP "
                         "wrapper, skipped the round's aggregation): nothing of it is recorded", skipped)
        self._pending.clear()  # each holds its round's arrays
        if isinstance(grid, LocalGrid):  # evaluation too, before a round trains for nothing
            grid.check_enough_nodes(self.strategy, "train")
            if strategy_attribute(self.strategy, "fraction_evaluate", None) != 0:
                grid.check_enough_nodes(self.strategy, "evaluate")
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.ask_hardware_s is not None:
            self._ask_hardware(server_round, grid, [m.metadata.dst_node_id for m in messages])
        self._planned_indices = {}
        plan = self.plan(server_round, [m.metadata.dst_node_id for m in messages])
        messages = [m for m in messages if m.metadata.dst_node_id in plan]  # the others sit this round out
        # Redis is asked once a round, by plan(): a second lookup would wait out a stalled Redis twice
        missing = [node for node in plan if node not in self._planned_indices]  # a plan() override's own nodes
        if missing:
            self._planned_indices.update(zip(missing, self._worker_indices(missing)))
        workers = {node: self._planned_indices[node] for node in plan}
        self._pending[server_round] = _Round(arrays, plan, workers, self._predicted_s(plan, workers),
                                             time.monotonic(), messages)
        sent_at = time.time()
        for message in messages:
            self._personalise(message, plan[message.metadata.dst_node_id])
            # The wrapped strategy stamped the message before the plan was made: a client's MessageClock would
            # count the plan (a Redis that stalls holds it seconds) as its download, and the model would learn it
            # as that client's overhead. The message is made now, as it is handed to Flower.
            message.metadata.created_at = max(message.metadata.created_at, sent_at)
        return messages

    def plan(self, server_round: int, nodes: list[int]) -> dict[int, Workload]:
        """Each asked node's workload: equal predicted finish under the capacity model, round total fixed (or,
        with ``compensate_dropouts``, raised so that the samples expected back from the available clients make
        it). A node that sits the round out (``sit_out``) has no workload."""
        if not nodes:
            return {}
        unit = self.batch_size if self.adapt == "batch" else self.local_steps
        workers = self._worker_indices(nodes)
        self._planned_indices = dict(zip(nodes, workers))  # configure_train sends the plan under these
        self._learn_hardware(self._round_base + server_round, nodes, workers)
        time_model = self._time_model(workers)
        available = self.model.availability(workers)
        total = unit * len(nodes)
        stay = self.rounds_out.due(workers)
        self._check_sit_out(len(nodes))
        dropout = weighed_dropout(available)
        sizes, reason = self._split(time_model, total, stay, dropout)
        if self.compensate_dropouts and total < MAX_BATCH and available @ sizes < total:
            sizes, reason = self._compensated(time_model, total, available, stay, dropout)
        reason += f"; {available @ sizes / total:.0%} of {total} expected back"
        self.rounds_out.record(workers, sizes)
        deadlines: list[float | None] = [None] * len(nodes)
        if self.deadline_slack is not None and time_model is not None:
            finish = self.deadline_slack * predicted_makespan(time_model, sizes)
            deadlines = [min(max(finish - float(t), 1e-3), MAX_SECONDS) for t in np.atleast_1d(time_model.overhead)]
        asked = sorted((n, int(s), d) for n, s, d in zip(nodes, sizes, deadlines) if s > 0)
        out = sorted(n for n, s in zip(nodes, sizes) if s == 0)
        log(INFO, "lbbsp round %d: %s; %s by node %s%s", server_round, reason,
            "batch size" if self.adapt == "batch" else "local steps", {n: s for n, s, _ in asked},
            f"; sitting out: nodes {out}" if out else "")
        if self.adapt == "batch":
            return {n: Workload(s, self.local_steps, d) for n, s, d in asked}
        return {n: Workload(self.batch_size, s, d) for n, s, d in asked}

    def _ask_hardware(self, server_round: int, grid: Grid, nodes: list[int]) -> None:
        """Ask each of ``nodes`` whose hardware is not known for it (once a run), waiting at most ``ask_hardware_s``.
        A node that answers with an error (no ``@app.query()``), not in time, or with a bad record, is planned as
        before (logged): it still gets its round."""
        hardware = getattr(self.model, "hardware_", {})
        new = [n for n in nodes if n not in self._asked_hardware and self.history.known_index(n) not in hardware]
        if not new:
            return
        self._asked_hardware.update(new)
        queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY, group_id=str(server_round))
                   for node in new]
        unanswered = set(new)
        failed: dict[str, list[int]] = {}  # why -> the nodes that gave no hardware for it: a line each, not a node
        for reply in grid.send_and_receive(queries, timeout=self.ask_hardware_s):
            node = reply.metadata.src_node_id
            unanswered.discard(node)
            try:
                if reply.has_error():
                    raise ProtocolError(printable(reply.error.reason or "error reply", MAX_CLIENT_REASON_CHARS),
                                        field="query")
                answer = ClientHardware.from_content(reply.content)
                if answer is None:
                    raise ProtocolError("is missing from the answer", field=HARDWARE)
            except ProtocolError as exc:
                failed.setdefault(printable(str(exc), MAX_REASON_CHARS), []).append(node)
            else:
                if node in new:
                    self._announced[node] = answer
        if unanswered:  # (it had gone unsaid: the round waited ask_hardware_s, and the log did not say why)
            failed[f"no answer within ask_hardware_s={self.ask_hardware_s:g} s; a SuperNode that starts a ClientApp "
                   "for each message needs its start-up too"] = list(unanswered)
        for why, silent in failed.items():
            log(WARNING, "lbbsp round %d: nodes %s gave no hardware (%s): planned as typical clients", server_round,
                sorted(silent), why)

    def _learn_hardware(self, iteration: int, nodes: list[int], workers: list[int]) -> None:
        """Teach the model the hardware that ``nodes`` answered with, as reports of no sample (announcements, which
        measure nothing), so that the cold-start prior sizes them like their peers."""
        announcements = [Report(self.history.job, worker, iteration, 0, 0.0, features={"cores": hardware.cores},
                                device=hardware.device)
                         for node, worker in zip(nodes, workers) if (hardware := self._announced.pop(node, None))]
        if announcements:
            self.model.partial_fit(announcements)
            self._said.update((report.worker, hardware_of(report)) for report in announcements)

    def _measured_hardware(self, server_round: int, reports: list[Report], workers: dict[int, int]) -> None:
        """Let each client's first measured reply set its hardware where its answer to the query named other hardware
        (``hardware_reply`` and ``LocalRound`` given different devices; the model keeps a worker's first hardware, and
        had kept the answer's for the run, while the history stores the replies'), warning once a node."""
        hardware = getattr(self.model, "hardware_", None)
        if not self._said or hardware is None:
            return
        node_of = {worker: node for node, worker in workers.items()}
        moved: dict[int, tuple[tuple[str, int], tuple[str, int]]] = {}  # node -> (answered, replied)
        for report in reports:
            said = self._said.pop(report.worker, None)
            if said is not None and (measured := hardware_of(report)) != said:
                hardware.pop(report.worker, None)  # partial_fit records the reply's
                moved[node_of.get(report.worker, -1)] = (said, measured)
        if moved:
            first = min(moved)
            log(WARNING, "lbbsp round %d: nodes %s answered the hardware query with other hardware than their replies "
                         "say (node %d: %s, then %s): the replies' counts; give hardware_reply the device LocalRound "
                         "gets", server_round, sorted(moved), first, *map(_hardware_said, moved[first]))

    def _compensated(self, time_model: LinearTime | None, total: int, available: np.ndarray, stay: np.ndarray,
                     dropout: np.ndarray | None) -> tuple[np.ndarray, str]:
        """The split of the smallest total (at most ``MAX_COMPENSATION`` x ``total``, and what ``max_size`` holds)
        whose samples expected back reach ``total``; the largest total's where none does.

        The samples back are not monotone in the total: with ``dropout`` weighed, the cap or even mix that
        :func:`lbbsp.dropouts.dropout_bounds` keeps flips as the costs cross (one total more than one that sufficed
        brought back 14 fewer, a fast unreliable client uncapped), and rounding moves samples between clients of
        unlike availability. A bisection alone steps into such dips: in 150 draws of 3-16 clients it asked over the
        smallest in 7 (2-18 over; 333 where 326 sufficed in a review's). So the ``COMPENSATION_SCAN`` totals below
        the one it finds are tried too: 1 of those draws is still over (18). Trying every total would be exact but
        costs a split each (2-5 ms); at 1,024 clients no total within 200 below the bisection's sufficed."""
        high = min(MAX_COMPENSATION * total, self._largest(MAX_COMPENSATION * total) * stay.size, MAX_BATCH)
        splits: dict[int, tuple[np.ndarray, str]] = {}

        def suffices(candidate: int) -> bool:
            if candidate not in splits:
                splits[candidate] = self._split(time_model, candidate, stay, dropout)
            return bool(available @ splits[candidate][0] >= total)

        low, top = total, high
        while low < top:
            middle = (low + top) // 2
            if suffices(middle):
                top = middle
            else:
                low = middle + 1
        smallest = next((c for c in range(max(total, low - COMPENSATION_SCAN), low + 1) if suffices(c)), low)
        return splits[smallest]

    def _split(self, time_model: LinearTime | None, total: int, stay: np.ndarray,
               dropout: np.ndarray | None = None) -> tuple[np.ndarray, str]:
        """``total`` (which the bounds hold) split over the clients for equal predicted finish, within the
        bounds; those in ``stay`` do not sit out; with each client's ``dropout`` chance, the largest shares capped
        where that pays (:func:`lbbsp.dropouts.dropout_bounds`). Equal before any measurement."""
        count = stay.size
        if time_model is None:
            return np.array(equal_split(total, count)), "equal split (no measurements yet)"
        if total > MAX_BATCH:
            if ("too large", 0) not in self._told:
                self._told.add(("too large", 0))
                log(WARNING, "lbbsp: a round total over %s (here %s) is split equally, not balanced: fewer clients a "
                             "round or a smaller %s keeps rounds balanced", f"{MAX_BATCH:,}", f"{total:,}",
                    "batch_size" if self.adapt == "batch" else "local_steps")
            return np.array(equal_split(total, count)), f"equal split (round total over {MAX_BATCH:,})"
        lower, upper = np.full(count, self.min_size), np.full(count, self._largest(total))

        def split(bounds: np.ndarray) -> np.ndarray:
            return allocate_sitting_out(time_model, total, lower, bounds, self.sit_out, MIN_GAIN, stay=stay)

        # a client that sends no reply is waited on until the round's timeout: the round ends with every client asked
        sizes = split(upper) if dropout is None else dropout_bounds(time_model, total, lower, upper, dropout, split,
                                                                    waits_for_all=True)[1]
        chosen, balanced = damp(equal_split(total, count), sizes, time_model, MIN_GAIN)
        predicted = predicted_makespan(time_model, chosen)
        if not balanced:
            return chosen, f"equal split (balancing gains under {MIN_GAIN:.0%}; predicted round {predicted:.3g}s)"
        return sizes, f"predicted round {predicted:.3g}s"

    def _largest(self, total: int) -> int:
        """The most one client may be given of a round ``total``: ``max_size``, and no more samples in a round
        than a Report can carry (``MAX_BATCH``), nor, adapting local steps, more than ``MAX_LOCAL_STEPS``."""
        if self.adapt == "batch":
            return min(self.max_size or total, total, MAX_BATCH // self.local_steps)
        return min(self.max_size or total, total, MAX_BATCH // self.batch_size, MAX_LOCAL_STEPS)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        sent = self._pending.pop(server_round, None)
        if sent is None:  # Flower's loop configures each round before it aggregates it: a direct call, or a wrapper's
            log(WARNING, "lbbsp round %d: LoadBalanced sent no workload for this round (aggregated already, or not "
                         "configured through it): its replies are not checked against a plan, nor recorded",
                server_round)
        replies = [_with_printable_error(m) for m in self._first_reply_each(server_round, _addressed(replies, sent))]
        if sent is not None:
            predicted = "" if sent.predicted_s is None else f" (predicted {sent.predicted_s:.3g}s)"
            log(INFO, "lbbsp round %d: took %.3gs%s", server_round, time.monotonic() - sent.started, predicted)
        results = self.observe(server_round, replies, sent)
        if sent is not None:
            self._warn_of_leaping_data_sizes(server_round, results)
            self.normalise(sent, replies, results)
        passed = [m for m in replies if m.has_error() or m.metadata.src_node_id in results]
        return self.strategy.aggregate_train(server_round, [self._without_lbbsp_metrics(m) for m in passed])

    def observe(self, server_round: int, replies: list[Message],
                sent: _Round | None) -> dict[int, ClientResult | None]:
        """Validate each reply's results, record every sampled client's outcome in Redis, teach the model.

        Returns the replies to aggregate, by node: their results, or None for a reply without lbbsp's metrics
        (a plain Flower ClientApp, logged once per node), which counts as completed but measures nothing.
        A reply that fails :meth:`check_reply` is left out as failed (logged), whatever weight it claims.
        """
        results: dict[int, ClientResult | None] = {}
        outcomes: dict[int, ClientStatus] = {}
        reports = []
        workers = sent.workers if sent is not None else {}
        iteration = self._round_base + server_round
        now = time.time()
        self._last_iteration = max(self._last_iteration, iteration)
        odd = self._unlike_the_others(replies)
        for message in replies:
            node = message.metadata.src_node_id
            worker = workers.get(node)
            reason = (message.error.reason or "error reply") if message.has_error() else odd.get(node, "")
            if not reason:
                try:
                    results[node], report = self.check_reply(message, sent, worker, iteration)
                except ProtocolError as exc:
                    reason = f"bad reply: {exc}"
                else:
                    if report is not None:
                        reports.append(report)
            if reason:  # a bad reply's may quote the sender's words (a dtype label)
                reason = printable(reason, MAX_REASON_CHARS)
                if LEGACY_CLIENT in reason:  # Flower's own KeyError, from a NumPyClient given a Message API round
                    reason += (" (a legacy NumPyClient or client_fn ClientApp: LoadBalanced sends Message API rounds; "
                               "move the ClientApp to @app.train() with LocalRound, docs/flower.md)")
                log(WARNING, "lbbsp round %d: node %d failed and is left out: %s", server_round, node, reason)
            if worker is not None:
                outcomes[worker] = ClientStatus(iteration, "failed" if reason else "ok", reason, now)
        for node in set(workers) - {m.metadata.src_node_id for m in replies}:
            log(WARNING, "lbbsp round %d: node %d sent no reply in time and is left out", server_round, node)
            outcomes[workers[node]] = ClientStatus(iteration, "missed", "no reply before the timeout", now)
        self._tell_once("plain", [n for n, result in results.items() if result is None], WARNING,
                        "lbbsp: nodes %s reply without lbbsp's metrics (a ClientApp without LocalRound?): their "
                        "updates are aggregated as they are, and nothing is learned of their speed")
        self._measured_hardware(server_round, reports, workers)
        self.model.partial_fit(reports)
        self.model.record_outcomes({worker: outcome.status == "ok" for worker, outcome in outcomes.items()})
        try:  # a temporary index (above _next_temporary) means nothing to Redis
            self.history.record([r for r in reports if r.worker <= self._next_temporary],
                                {w: o for w, o in outcomes.items() if w <= self._next_temporary})
        except StoreUnavailable as exc:
            log(WARNING, "lbbsp round %d: history not saved, Redis unavailable: %s", server_round, exc)
        return results

    def check_reply(self, message: Message, sent: _Round | None, worker: int | None,
                    iteration: int) -> tuple[ClientResult | None, Report | None]:
        """A reply's results and its Report (None without a worker index); (None, None) for a plain reply.

        Raises a ProtocolError unless the results are valid, claim no more than the workload sent
        (:meth:`ClientResult.check`) and make a valid Report, and the arrays have the keys and shapes of the
        model sent: an lbbsp reply's weight and FedNova scale come from its own claims.
        """
        records = message.content.metric_records
        if sent is not None:  # every train reply, a plain Flower one too: it is averaged into the model
            if message.metadata.src_node_id not in sent.plan:
                raise ProtocolError("this node was sent no workload this round", field="node")
            _check_arrays(sent, message.content)
        if len(records) != 1:  # the strategy would refuse the round (InconsistentMessageReplies), not the reply
            raise ProtocolError(f"must hold one MetricRecord, holds {len(records)}", field="metrics")
        metrics = next(iter(records.values()))
        if not has_timings(metrics):
            weight = metrics.get(self.weighted_by_key)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not _finite(weight) or weight <= 0:
                raise ProtocolError(f"a reply without lbbsp's metrics must give its weight as a finite number above 0 "
                                    f"(the examples it trained on), got {weight!r:.40}", field=self.weighted_by_key)
            return None, None
        result = ClientResult.from_metrics(metrics)
        if sent is not None:
            result.check(sent.plan[message.metadata.src_node_id])
        if result.samples == 0 or result.steps == 0:
            raise ProtocolError("processed no sample: a ClientApp trains one step per batch size of `for batch_size "
                                "in rnd.batches():`, and a reply counts only the steps taken in that loop",
                                field=SAMPLES)
        if result.weight(self.weight_by) == 0:
            raise ProtocolError(f"is 0, and with weight_by={self.weight_by!r} the reply would weigh nothing",
                                field=DATA_SIZE)
        hardware = ClientHardware.from_content(message.content)
        if worker is None:
            return result, None
        features = {"download_s": result.download_s, "upload_s": result.upload_s}
        if hardware is not None:  # the models' cold-start prior groups clients by device and cores
            features["cores"] = hardware.cores
        try:
            return result, Report(self.history.job, worker, iteration, result.samples, result.compute_s,
                                  features=features, device=hardware.device if hardware is not None else "cpu")
        except ProtocolError as exc:  # name the metric the client sent; the log line names its node
            metric = REPORT_METRICS.get(exc.field or "")
            if metric is None:
                raise
            raise ProtocolError(exc.message.removeprefix(f"{exc.field}: "), field=metric) from None

    def _first_reply_each(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Each node's first reply; a second one (a grid that delivers a reply twice) is logged and dropped: it would
        count the node's update twice, once under a weight ``normalise`` never set."""
        first: dict[int, Message] = {}
        for message in replies:
            node = message.metadata.src_node_id
            if node in first:
                log(WARNING, "lbbsp round %d: node %d replied more than once; only its first reply counts",
                    server_round, node)
            else:
                first[node] = message
        return list(first.values())

    def _warn_of_leaping_data_sizes(self, server_round: int, results: dict[int, ClientResult | None]) -> None:
        """Warn, once a node, of a data size over ``DATA_SIZE_LEAP`` times the node's previous one in this run or the
        median of the round's other clients: it weights the node's update, and no check can tell it is wrong."""
        sizes = {node: r.data_size for node, r in results.items() if r is not None and r.data_size is not None}
        values = np.array(list(sizes.values()), dtype=float)
        for i, (node, size) in enumerate(sizes.items()):
            if self.weight_by == "samples" or ("data size", node) in self._told:
                continue
            said = []
            previous = self._data_sizes.get(node)
            if previous and size > DATA_SIZE_LEAP * previous:
                said.append(f"{size / previous:,.0f}x its own previous report ({previous:,})")
            if values.size > 1 and size > DATA_SIZE_LEAP * values.min():  # else no median of the others is so low
                median = float(np.median(np.delete(values, i)))
                if size > DATA_SIZE_LEAP * median:
                    said.append(f"{size / median:,.0f}x the median ({median:,.0f}) of the round's other "
                                f"{values.size - 1} clients")
            if said:
                self._told.add(("data size", node))
                log(WARNING, "lbbsp round %d: node %d reports a data size of %s: %s; FedAvg weights its update by it "
                             "(weight_by=%r), and lbbsp cannot check it: if it is wrong, the model leans toward this "
                             "client's data", server_round, node, f"{size:,}", " and ".join(said), self.weight_by)
        self._data_sizes.update(sizes)

    def _unlike_the_others(self, replies: list[Message]) -> dict[int, str]:
        """Why each reply whose records are laid out unlike most of the round's is left out, by node: the
        wrapped strategy refuses a round whose replies differ in record names or metric keys, so one odd reply
        would otherwise cost every client's update. The layout most replies share is kept (on a tie, the
        first reply's)."""
        layouts = {m.metadata.src_node_id: self._layout(m) for m in replies if not m.has_error()}
        if len(set(layouts.values())) < 2:
            return {}
        counts = Counter(layouts.values())
        kept = max(counts, key=counts.__getitem__)  # Counter keeps the first-seen order; max takes the first best
        return {node: f"bad reply: its records {_describe(layout)} differ from the round's others "
                      f"{_describe(kept)}" for node, layout in layouts.items() if layout != kept}

    def _layout(self, message: Message) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]:
        """What the wrapped strategy needs alike in every reply: the names of the ArrayRecords and MetricRecords
        and the metric keys that reach it (lbbsp's own are removed; the weight key is set)."""
        content = message.content
        keys = {name for record in content.metric_records.values() for name in record.keys()
                if not name.startswith(LBBSP_PREFIX)}
        return (tuple(sorted(content.array_records.keys())), tuple(sorted(content.metric_records.keys())),
                frozenset(keys | {self.weighted_by_key}))

    def normalise(self, sent: _Round, replies: list[Message], results: dict[int, ClientResult | None]) -> None:
        """Set each lbbsp reply's weight (``weight_by``); rescale updates FedNova-style if steps differ.

        Plain Flower replies (None in ``results``) keep their own weight and update. (A reply of no sample or
        of weight 0 failed :meth:`check_reply`.)
        """
        measured = {node: result for node, result in results.items() if result is not None}
        weights = {node: result.weight(self.weight_by) for node, result in measured.items()}
        if self.weight_by != "samples":
            self._tell_once("no data size", [n for n in weights if measured[n].data_size is None],
                            WARNING if self.weight_by == "data" else INFO,
                            "lbbsp: nodes %s report no data size (LocalRound(data_size=...)): weighted by the "
                            "samples they processed")
        if not weights:
            return
        nodes = list(weights)
        scales = fednova_scales([measured[n].steps for n in nodes], [weights[n] for n in nodes])
        by_node = {m.metadata.src_node_id: m for m in replies if not m.has_error()}
        self._tell_once("weight key", [n for n in nodes if not any(
            self.weighted_by_key in record for record in by_node[n].content.metric_records.values())],
            WARNING, f"lbbsp: nodes %s sent no {self.weighted_by_key!r}, the strategy's weight key: give their "
                     f"LocalRound weighted_by_key={self.weighted_by_key!r}, or the weight key they send instead "
                     f"reaches the strategy's train metrics as a metric of their own")
        if self._client_clipped:  # a client that took fewer steps (its data ran out): its update as it clipped it
            self._tell_once("clipped", [n for n, scale in zip(nodes, scales) if scale > 1 + 1e-12], WARNING,
                            "lbbsp: nodes %s took fewer local steps than the others; under client-side clipping the "
                            "round's updates are averaged as the clients clipped them, without FedNova's rescaling, "
                            "which would stretch theirs past the clipping norm")
            scales = np.ones_like(scales)
        for node, scale in zip(nodes, scales):
            message = by_node[node]
            content = RecordDict(dict(message.content.items()))
            metrics = next(iter(content.metric_records.values()))
            metrics[self.weighted_by_key] = weights[node]
            if not np.isclose(scale, 1.0, rtol=1e-12, atol=0):
                key, local = next(iter(content.array_records.items()))
                names = list(local.keys())  # paired by name: check_reply made sure the model has these names
                rescaled = rescale_update([sent.arrays[k].numpy() for k in names], [local[k].numpy() for k in names],
                                          float(scale))
                content[key] = ArrayRecord({k: Array(v) for k, v in zip(names, rescaled)})
            message.content = content

    # -- evaluation: the wrapped strategy's own ----------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if isinstance(grid, LocalGrid) and strategy_attribute(self.strategy, "fraction_evaluate", None) != 0:
            grid.check_enough_nodes(self.strategy, "evaluate")
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

    def _without_lbbsp_metrics(self, message: Message) -> Message:
        """The reply with lbbsp's own ``lbbsp-*`` metrics and hardware record removed (the weight key kept), so that
        replies with and without optional ones (a data size) or without any (a plain ClientApp) aggregate together."""
        if message.has_error():
            return message
        content = RecordDict({name: record for name, record in message.content.items() if name != HARDWARE})
        for key, record in message.content.metric_records.items():
            content[key] = MetricRecord({name: value for name, value in record.items()
                                         if not name.startswith(LBBSP_PREFIX) or name == self.weighted_by_key})
        message.content = content
        return message

    def _worker_indices(self, nodes: list[int]) -> list[int]:
        """Each node's worker index in the history. While Redis is unreachable, a node it indexed keeps its
        index, and one it has not gets a temporary one, kept in memory (logged): it is planned as a typical
        client, and nothing of it is stored."""
        try:
            indices = self.history.worker_indices(nodes)
        except StoreUnavailable as exc:
            return [self._index_while_unreachable(node, exc) for node in nodes]
        for node in nodes:
            self._temporary.pop(node, None)
        return indices

    def _index_while_unreachable(self, node: int, exc: StoreUnavailable) -> int:
        """The index the history last gave ``node``, else a temporary one (logged once)."""
        known = self.history.known_index(node)
        if known is not None:
            return known
        if node not in self._temporary:
            self._temporary[node] = self._next_temporary
            self._next_temporary -= 1
            log(WARNING, "lbbsp: node %d gets a temporary index (%s); it is planned as a typical client and "
                         "its results are not stored", node, exc)
        return self._temporary[node]

    def _predicted_s(self, plan: dict[int, Workload], workers: dict[int, int]) -> float | None:
        """The round's predicted seconds for ``plan``; None before any measurement."""
        time_model = self._time_model([workers[n] for n in plan])
        if time_model is None:
            return None
        sizes = [w.batch_size if self.adapt == "batch" else w.local_steps for w in plan.values()]
        return predicted_makespan(time_model, sizes)

    def _check_sit_out(self, sampled: int) -> None:
        """Warn, once, when ``sit_out`` of this many sampled clients rounds down to no client at all."""
        if self.sit_out > 0 and int(self.sit_out * sampled + 1e-9) == 0 and not self._told_sit_out:
            self._told_sit_out = True
            log(WARNING, "lbbsp: sit_out=%g of %d sampled clients rounds down to no client: none sits out (one "
                         "may from %d sampled on)", self.sit_out, sampled, math.ceil((1 - 1e-9) / self.sit_out))

    def _tell_once(self, what: str, nodes: list[int], level: int, message: str) -> None:
        """Log ``message`` with the nodes not yet told about ``what``, if any."""
        new = sorted(n for n in nodes if (what, n) not in self._told)
        if new:
            self._told.update((what, n) for n in new)
            log(level, message, new)


def _addressed(replies: Iterable[Message], sent: _Round | None) -> list[Message]:
    """The replies, an error the SuperLink sent in a node's place ("Node Unavailable", from its own node id, 1) made
    the reply of the node it was sent to: it had been logged as node 1's failure, the node as one that sent no reply,
    and a second such error dropped as node 1's second reply."""
    replies = list(replies)
    if sent is None:
        return replies
    by_id = {m.metadata.message_id: m for m in sent.messages if m.metadata.message_id}
    for i, reply in enumerate(replies):
        original = by_id.get(reply.metadata.reply_to_message_id) if reply.has_error() else None
        if original is not None and original.metadata.dst_node_id != reply.metadata.src_node_id:
            replies[i] = Message(reply.error, reply_to=original)
    return replies


def _hardware_said(hardware: tuple[str, int]) -> str:
    """A hardware key as a log line says it: the device and its cores."""
    device, cores = hardware
    return f"device {printable(device, 64)!r} ({cores} cores)" if cores else f"device {printable(device, 64)!r}"


def _check_arrays(sent: _Round, content: RecordDict) -> None:
    """Raise a ProtocolError unless ``content`` holds one ArrayRecord with the arrays of the model ``sent``, by name,
    shape and dtype (in any order), and finite: one NaN, or a complex or string array, would spoil or stop the
    average."""
    model = sent.arrays
    if len(content.array_records) != 1:
        raise ProtocolError(f"must hold one ArrayRecord, holds {len(content.array_records)}", field="arrays")
    local = next(iter(content.array_records.values()))
    if set(local.keys()) != set(model.keys()):
        raise ProtocolError(f"names {sorted(local.keys())[:8]} are not the model's {sorted(model.keys())[:8]}",
                            field="arrays")
    for name, array in local.items():
        if tuple(array.shape) != tuple(model[name].shape):
            raise ProtocolError(f"shape {tuple(array.shape)}, the model's is {tuple(model[name].shape)}",
                                field=f"arrays.{name}")
        if not _dtype_fits(array.dtype, model[name].dtype):
            raise ProtocolError(f"dtype {array.dtype}, the model's is {model[name].dtype}", field=f"arrays.{name}")
        try:  # the labels above are the sender's word: the bytes decide what the average gets
            values = array.numpy()
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"cannot be read as an array: {exc}", field=f"arrays.{name}") from None
        shape, dtype = sent.layout[name]
        if values.shape != shape or not _dtype_fits(values.dtype, dtype):
            raise ProtocolError(f"holds a {values.dtype} array of shape {values.shape}, the model's is "
                                f"{dtype} of shape {shape}", field=f"arrays.{name}")
        if values.dtype.kind in "fc" and not np.isfinite(values).all():
            raise ProtocolError("holds NaN or infinite values", field=f"arrays.{name}")


def _with_printable_error(message: Message) -> Message:
    """The reply, its error reason (if it is an error reply) escaped and cut to ``MAX_CLIENT_REASON_CHARS``: both
    LoadBalanced and the wrapped strategy log it, and the history stores it."""
    if message.has_error() and message.error.reason:
        message.error = Error(message.error.code, printable(message.error.reason, MAX_CLIENT_REASON_CHARS))
    return message


def _dtype_fits(reply: str | np.dtype, model: str | np.dtype) -> bool:
    """Whether a reply's array of dtype ``reply`` may be averaged into the model's of dtype ``model``: the same, or
    an integer or bool array (a counter, a mask) where the model's is float, since Flower's weighted average turns
    such an array float after round 1 and the clients still return it in their own dtype."""
    if reply == model:
        return True
    try:  # a label is the sender's word, and may name no dtype at all
        return np.dtype(reply).kind in "biu" and np.dtype(model).kind == "f"
    except (TypeError, ValueError):
        return False


def _describe(layout: tuple[tuple[str, ...], tuple[str, ...], frozenset[str]]) -> str:
    arrays, metrics, keys = layout
    return f"(arrays {list(arrays)}, metrics {list(metrics)} with keys {sorted(keys)[:8]})"


def _why_not(strategy: object) -> str:
    """A hint for a strategy that ``LoadBalanced`` cannot wrap but a user may well pass: a class, or one of
    Flower's legacy strategies (``flwr.server.strategy``), whose ClientApps speak another message layout."""
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        return f": pass an instance, {strategy.__name__}(...), not the class"
    if type(strategy).__module__.startswith("flwr.server.strategy"):
        return (": that is a legacy strategy (flwr.server.strategy); use its message-API namesake from "
                "flwr.serverapp.strategy, with a ClientApp built on @app.train() (Flower's migration guide)")
    return ""


def _whole(name: str, value: object) -> int:
    """``value`` as a positive whole number, or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
