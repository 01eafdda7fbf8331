"""Client side of the Flower plugin: run the workload the server assigned, time it, and say so in the reply.

The server sends each client its own :class:`Workload` in the train message's ConfigRecord. A ClientApp
wraps its local loop in a :class:`LocalRound`, which yields the batch size once per local step, times only
the loop body (local compute), stops early if the round's compute deadline would pass, and builds the reply
with the samples actually processed, the download, compute and upload seconds, and the client's hardware
(:class:`ClientHardware`, a ConfigRecord :data:`HARDWARE`; :func:`hardware_reply` answers the server's query for it).

Inside a ClientApp the model has already arrived and the reply leaves after it returns, so transfer time is
not directly observable. A :class:`Link` says what it was: :class:`MessageClock` (the default) reports the time
since the server created the message (delivery and start-up included) as the download and no upload;
:class:`EmulatedLink` sleeps bytes / bandwidth each way, for experiments with emulated clients (with
``count_delivery=True``, on a deployment, the real delivery and start-up as well).
"""
from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from lbbsp.config import _integer, _real
from lbbsp.errors import ConfigError, ProtocolError
from lbbsp.protocol import FEATURE_RANGES, MAX_BATCH, MAX_DEVICE_CHARS, MAX_SECONDS, _flag
from lbbsp.telemetry import available_cores

#: Keys of the per-client ConfigRecord entries the server sends.
BATCH_SIZE = "lbbsp-batch-size"
LOCAL_STEPS = "lbbsp-local-steps"
DEADLINE_S = "lbbsp-deadline-s"
#: Keys of the reply metrics the client sends back (besides the strategy's weight key, "num-examples").
SAMPLES, STEPS, DATA_SIZE = "lbbsp-samples", "lbbsp-steps", "lbbsp-data-size"
COMPUTE_S, DOWNLOAD_S, UPLOAD_S = "lbbsp-compute-s", "lbbsp-download-s", "lbbsp-upload-s"
#: The reply's ConfigRecord with the client's hardware (a MetricRecord holds numbers only, and the device is a name).
HARDWARE = "lbbsp-hardware"
MAX_LOCAL_STEPS = 1_000_000
#: The prefix of every key lbbsp adds to a ConfigRecord or a reply's MetricRecord.
LBBSP_PREFIX = "lbbsp-"

_told: set[str] = set()  # what this process has logged once (LocalGrid runs the ClientApps as its threads)
_told_lock = threading.Lock()


def _log_once(what: str, level: int, message: str) -> None:
    """Log ``message`` unless this process has already logged ``what``."""
    with _told_lock:
        if what in _told:
            return
        _told.add(what)
    log(level, message)


@dataclass(frozen=True)
class Workload:
    """One client's share of one round: ``local_steps`` steps of ``batch_size`` samples each.

    ``deadline_s``, when set, is the local compute time the client may spend; it stops before a step that
    would end past it, and the server's aggregation accounts for the steps it did not take.
    """

    batch_size: int
    local_steps: int
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        # numpy's integers and floats pass as plain ones (they go into a ConfigRecord); True is not a deadline
        object.__setattr__(self, "batch_size", _integer(self.batch_size, "batch_size", 1, MAX_BATCH))
        object.__setattr__(self, "local_steps", _integer(self.local_steps, "local_steps", 1, MAX_LOCAL_STEPS))
        if self.deadline_s is not None:
            object.__setattr__(self, "deadline_s", _real(self.deadline_s, "deadline_s", 0.0, MAX_SECONDS,
                                                         f"in (0, {MAX_SECONDS}]", lo_open=True))
        if self.samples > MAX_BATCH:  # the round's samples go into one Report
            raise ConfigError(f"batch_size x local_steps must be at most {MAX_BATCH:,} samples a round, got "
                              f"{self.batch_size} x {self.local_steps}")

    @property
    def samples(self) -> int:
        """The round's samples, ``batch_size`` x ``local_steps``: what the client's Report counts."""
        return self.batch_size * self.local_steps

    def to_config(self) -> dict[str, int | float]:
        """The workload as the entries of a train ConfigRecord, read back by :meth:`from_config`."""
        config: dict[str, int | float] = {BATCH_SIZE: self.batch_size, LOCAL_STEPS: self.local_steps}
        if self.deadline_s is not None:
            config[DEADLINE_S] = float(self.deadline_s)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any], default: Workload | None = None) -> Workload:
        """Read a workload from a ConfigRecord; ``default`` when the server sent none (a plain strategy)."""
        if BATCH_SIZE not in config and default is not None:
            return default
        try:
            return cls(config[BATCH_SIZE], config[LOCAL_STEPS], config.get(DEADLINE_S))
        except KeyError as exc:
            raise ProtocolError("is missing from the train config: wrap the server's strategy in LoadBalanced, or, for "
                                "a plain strategy, pass LocalRound(default=Workload(batch_size, local_steps))",
                                field=str(exc.args[0])) from None
        except ConfigError as exc:
            raise ProtocolError(exc.message, field="config") from None


@dataclass(frozen=True)
class ClientHardware:
    """What a client runs on: a ``device`` name ("cpu", "cuda", a phone model) and its ``cores``. The server gives a
    client it has not measured yet the speed of clients with the same hardware (the cold-start prior)."""

    device: str
    cores: int

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not 0 < len(self.device) <= MAX_DEVICE_CHARS or (
                not self.device.isprintable()) or not self.device.strip():  # blank: it would be read as "cpu"
            raise ConfigError(f"device must be a printable name of 1 to {MAX_DEVICE_CHARS} characters, not all blank, "
                              f"such as 'cpu', 'cuda' or a phone model, got {self.device!r:.80}")
        lo, hi = FEATURE_RANGES["cores"]
        object.__setattr__(self, "cores", _integer(self.cores, "cores", int(lo), int(hi)))

    @classmethod
    def here(cls, device: str = "cpu") -> ClientHardware:
        """This process's hardware: ``device`` as given and the cores it may use (cgroup limits included)."""
        return cls(device, _cores())

    def to_config(self) -> ConfigRecord:
        """The hardware as the reply's ConfigRecord (under :data:`HARDWARE`), read back by :meth:`from_content`."""
        return ConfigRecord({"device": self.device, "cores": self.cores})

    @classmethod
    def from_content(cls, content: RecordDict) -> ClientHardware | None:
        """A reply's hardware; None where it sends none (a client before hardware was sent). A ProtocolError naming
        the field for a record that is not a device name and a whole number of cores, or holds anything else."""
        if HARDWARE not in content.config_records:
            return None
        record: Mapping[str, Any] = content.config_records[HARDWARE]  # checked below, by the dataclass
        unknown = sorted(set(record.keys()) - {"device", "cores"})
        if unknown:
            raise ProtocolError(f"unknown key(s) {', '.join(repr(k[:32]) for k in unknown[:4])} (known: device, cores)",
                                field=HARDWARE)
        for key in ("device", "cores"):
            if key not in record:
                raise ProtocolError("is missing", field=f"{HARDWARE}.{key}")
        try:
            return cls(record["device"], record["cores"])
        except ConfigError as exc:
            key = "cores" if exc.message.startswith("cores") else "device"
            raise ProtocolError(exc.message.removeprefix(f"{key} "), field=f"{HARDWARE}.{key}") from None


@functools.cache
def _cores() -> int:
    """:func:`lbbsp.telemetry.available_cores`, read once a process (a round need not read the cgroup files again)."""
    return available_cores()


def hardware_reply(msg: Message, device: str = "cpu") -> Message:
    """The reply to LoadBalanced's hardware query (``ask_hardware_s``), for a ClientApp's ``@app.query()``: the
    client's hardware, so that its first round is sized like its peers' on the same hardware."""
    return Message(RecordDict({HARDWARE: ClientHardware.here(device).to_config()}), reply_to=msg)


class Link(Protocol):
    """Says how long the model took to arrive and to leave, in seconds."""

    def download(self, msg: Message) -> float:
        """Seconds the train message ``msg`` took to arrive; called once, as the round starts."""
        ...

    def upload(self, nbytes: int) -> float:
        """Seconds the reply of ``nbytes`` bytes of arrays takes to leave; called once, as the round ends."""
        ...


def array_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a message's content: what crosses the network each way."""
    return sum(record.count_bytes() for record in content.array_records.values())


class MessageClock:
    """Download = now - the message's creation time (clocks assumed in sync); upload = 0, not observed.

    In a deployment that span holds more than the model's transfer: the message's wait in the SuperLink until
    the SuperNode polls for it, the ClientApp's start-up, and the download itself. Nothing in it scales with
    the model's bytes or the client's workload, so it is reported whole, as the round's fixed overhead
    (``lbbsp-download-s``), and no upload time is made up from it.
    """

    def download(self, msg: Message) -> float:
        """Seconds since the server created ``msg``, in [0, a day]."""
        # A clock skewed either way gives 0 or at most a day, not a span no Report can carry (the server would
        # refuse the whole reply, the update with it).
        return min(max(0.0, time.time() - msg.metadata.created_at), MAX_SECONDS)

    def upload(self, nbytes: int) -> float:
        """0: the reply's transfer is not observed from the client."""
        return 0.0


@dataclass(frozen=True)
class EmulatedLink:
    """A link of ``down_bps``/``up_bps`` bytes per second: sleeps bytes / bandwidth and reports that time.

    ``count_delivery=True`` reports as the download, after the sleep, the whole time since the server created
    the message (as :class:`MessageClock`; clocks assumed in sync), so the message's real delivery and the
    ClientApp's start-up count too. On a real deployment these are part of every round, often far more than
    the emulated times, and a plan that cannot see them overstates what moving work between clients gains.
    """

    down_bps: float
    up_bps: float
    count_delivery: bool = False

    def __post_init__(self) -> None:
        for name in ("down_bps", "up_bps"):
            _real(getattr(self, name), name, 0.0, math.inf, "a positive number of bytes per second", lo_open=True,
                  hi_open=True)
        _flag(self.count_delivery, "count_delivery")

    def download(self, msg: Message) -> float:
        """Sleep for the bytes of ``msg``'s arrays over ``down_bps`` and return those seconds (with
        ``count_delivery``, at least the time since the server created the message)."""
        seconds = self._transfer(array_bytes(msg.content), self.down_bps)
        return max(seconds, MessageClock().download(msg)) if self.count_delivery else seconds

    def upload(self, nbytes: int) -> float:
        """Sleep for ``nbytes`` over ``up_bps`` and return those seconds."""
        return self._transfer(nbytes, self.up_bps)

    @staticmethod
    def _transfer(nbytes: int, bps: float) -> float:
        seconds = nbytes / bps
        time.sleep(seconds)
        return seconds


class LocalRound:
    """One client's round: the assigned workload, timed, then the reply.

    >>> rnd = LocalRound(msg)                     # reads the workload, measures the download
    >>> for batch_size in rnd.batches():          # one local step per batch; only this body is timed
    ...     model.step(next_batch(batch_size))
    >>> return rnd.reply(ArrayRecord(model.arrays()), {"train-loss": loss})

    A step counts once the loop asks for the next batch size (or ends): a loop that stops early should
    ``break`` before a step's work, as ``zip(rnd.batches(), loader)`` does when the data runs out; a step
    broken out of after its work is not counted. A step whose batch came out short (the data ran out within it)
    says so with :meth:`last_batch`, and is the round's last. ``config_key`` None (the default) reads the workload from
    whichever ConfigRecord holds it (the strategy's ``configrecord_key``), else from "config". The reply carries the
    client's hardware (:class:`ClientHardware`): ``device`` names it ("cuda", a phone model; "cpu" by default).
    """

    def __init__(self, msg: Message, *, link: Link | None = None, default: Workload | None = None,
                 data_size: int | None = None, config_key: str | None = None,
                 weighted_by_key: str = "num-examples", device: str = "cpu") -> None:
        if not isinstance(msg, Message):
            raise ConfigError(f"msg must be the Message the ClientApp's train function receives first, as in "
                              f"train(msg, context), got {type(msg).__name__}")
        if default is not None and not isinstance(default, Workload):
            raise ConfigError(f"default must be a Workload(batch_size, local_steps), got {default!r}")
        if data_size is not None:
            _integer(data_size, "data_size", 0, None)  # a share of the average: whole and not negative
        if link is not None and not (callable(getattr(link, "download", None))
                                     and callable(getattr(link, "upload", None))):
            raise ConfigError(f"link must be a Link, with download(msg) and upload(nbytes) methods, such as "
                              f"MessageClock() or EmulatedLink(down_bps, up_bps), got {link!r:.60}")
        if not isinstance(weighted_by_key, str) or not weighted_by_key:
            raise ConfigError(f"weighted_by_key must be the strategy's weight key, a string such as 'num-examples', "
                              f"got {weighted_by_key!r}")
        if config_key is not None and not isinstance(config_key, str):
            raise ConfigError(f"config_key must be None or the name of a ConfigRecord, got {config_key!r}")
        self.hardware = ClientHardware.here(device)
        self.msg = msg
        self.data_size = data_size
        self.link = link if link is not None else MessageClock()
        self.weighted_by_key = weighted_by_key
        records = msg.content.config_records
        holding = next((name for name, record in records.items() if BATCH_SIZE in record), None)
        if config_key is not None and (config_key not in records or (holding is not None and config_key != holding)):
            # a misnamed key had read as "wrap the server's strategy in LoadBalanced", or ran the default workload
            where = (f"lbbsp's workload is in ConfigRecord {holding!r}: pass config_key={holding!r}, or leave it None"
                     if holding is not None else f"the message's ConfigRecords are {sorted(records)}")
            raise ConfigError(f"config_key {config_key!r} names no ConfigRecord of the train message that holds "
                              f"lbbsp's workload: {where}")
        if config_key is None:
            config_key = holding if holding is not None else "config"
        config: Mapping[str, Any] = records.get(config_key, {})
        if BATCH_SIZE not in config and default is not None:
            _log_once("no workload", WARNING,
                      f"lbbsp: no lbbsp workload in the train config (is the server's strategy wrapped in "
                      f"LoadBalanced?): the ClientApp runs its default, {default.batch_size} x "
                      f"{default.local_steps}, and its replies are weighted by the samples they processed (LocalRound "
                      f"sets {weighted_by_key!r} to them), not by data size, unless the strategy uses "
                      f'weighted_by_key="{DATA_SIZE}"')
        self.workload = Workload.from_config(config, default)
        self.download_s = self.link.download(msg)
        self.steps = 0
        self.samples = 0
        self.compute_s = 0.0
        self._looped = False
        self._in_step = False  # between batches()'s yield of a step and the loop's request for the next
        self._short: int | None = None  # the step in progress took this many samples (last_batch)

    def batches(self) -> Iterator[int]:
        """Yield the batch size once per local step, until the steps are done or the deadline would pass.

        A round is one loop: a second call raises a ConfigError (an epoch loop around it would take more steps
        than the server assigned, and the server would refuse the reply)."""
        if self._looped:
            raise ConfigError("batches() was called twice in one round: the round's workload is one loop of "
                              f"{self.workload.local_steps} local steps, `for batch_size in rnd.batches():`; "
                              "an epoch loop around it takes more steps than the server assigned")
        self._looped = True
        return self._steps()

    def _steps(self) -> Iterator[int]:
        work = self.workload
        for _ in range(work.local_steps):
            if work.deadline_s is not None and self.steps and (
                    self.compute_s * (self.steps + 1) / self.steps > work.deadline_s):
                return
            start = time.perf_counter()
            self._in_step = True
            try:
                yield work.batch_size
            finally:  # also where the loop is left at the yield
                self._in_step = False
            self.compute_s += time.perf_counter() - start
            self.steps += 1
            self.samples += work.batch_size if self._short is None else self._short
            if self._short is not None:  # the data ran out: no further step (the server allows only the last short)
                return

    def last_batch(self, samples: int) -> None:
        """The step in progress took only ``samples`` samples, at most its batch size (a loader without
        replacement ran out of data): it is counted so, and it is the round's last. Counted as a full batch, it
        had overstated the client's throughput (a client of 10 samples given batches of 32 read as 3.2x faster)."""
        if not self._in_step or self._short is not None:
            raise ConfigError("last_batch() is called inside `for batch_size in rnd.batches():`, once, in the step "
                              "whose batch came out short")
        _integer(samples, "last_batch's samples", 1, self.workload.batch_size)
        self._short = int(samples)

    def reply(self, arrays: ArrayRecord, metrics: Mapping[str, int | float] | None = None,
              array_key: str = "arrays", metric_key: str = "metrics") -> Message:
        """The train reply: the arrays, samples processed (the default weight), local data size if given, the
        round's timings (an emulated upload happens here) and the client's hardware. ``metrics`` must set none of
        these: a weight of its own (``num-examples`` = the data size, as a plain ClientApp sends) would be
        overwritten, so the data size goes in ``LocalRound(data_size=...)`` instead."""
        if not isinstance(arrays, ArrayRecord):
            raise ConfigError(f"arrays must be an ArrayRecord, e.g. ArrayRecord(list_of_ndarrays) or "
                              f"ArrayRecord(model.state_dict()), got {type(arrays).__name__}")
        if metrics is not None and not (isinstance(metrics, Mapping) and all(isinstance(k, str) for k in metrics)):
            raise ConfigError(f"metrics must be None or a mapping of names to numbers, such as "
                              f"{{'train-loss': 0.5}}, got {metrics!r:.60}")
        own = sorted(k for k in (metrics or {}) if k.startswith(LBBSP_PREFIX))
        if own:  # lbbsp's own keys: the data size advice below would not apply to them
            raise ConfigError(f"metrics must not set {own}: keys that start with {LBBSP_PREFIX!r} are lbbsp's own "
                              f"(the round's timings and samples, which reply() sets); rename yours")
        if self.weighted_by_key in (metrics or {}):
            raise ConfigError(f"metrics must not set {[self.weighted_by_key]}: LocalRound sets "
                              f"{self.weighted_by_key!r} to the samples processed and the server weights each reply "
                              f"by the data size passed as LocalRound(data_size=...); pass yours there and leave these "
                              f"keys out")
        upload_s = self.link.upload(arrays.count_bytes())
        record = MetricRecord(dict(metrics or {}))
        timings = {COMPUTE_S: self.compute_s, DOWNLOAD_S: self.download_s, UPLOAD_S: upload_s}
        for name, value in timings.items():
            record[name] = float(value) if math.isfinite(value) else 0.0
        record[self.weighted_by_key] = self.samples
        record[SAMPLES] = self.samples
        record[STEPS] = self.steps
        if self.data_size is not None:
            record[DATA_SIZE] = int(self.data_size)
        return Message(RecordDict({array_key: arrays, metric_key: record, HARDWARE: self.hardware.to_config()}),
                       reply_to=self.msg)
