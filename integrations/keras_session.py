"""A Keras worker's place in its job: which Keras ``tf.keras`` is, TF_CONFIG's worker index, and the
:class:`WorkerSession` that connects the worker to its job's Redis, coordinator and :class:`~lbbsp.WorkerClient`."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import numpy as np

from lbbsp.config import JobConfig, _is_integer, _real
from lbbsp.coordinator import checked_max_ahead
from lbbsp.coordinator_process import (
    EXTERNAL_MAX_AHEAD,
    EXTERNAL_POLICY,
    GRACE_BEFORE_OWN_SERVER_S,
    CoordinatorProcess,
    checked_process_policy,
)
from lbbsp.embedded import (
    FOLDER_PREFIX,
    EmbeddedRedis,
    check_private,
    remove_stale_folders,
    serve_embedded,
    server_listening,
    temp_parent,
)
from lbbsp.errors import ConfigError, StoreUnavailable
from lbbsp.policies import Policy
from lbbsp.protocol import _flag
from lbbsp.store import Store, agreed_config, redacted, wait_for_redis, worker_socket_timeout
from lbbsp.worker import WorkerClient, checked_outage

log = logging.getLogger("lbbsp.keras")


#: The values of TF_USE_LEGACY_KERAS that make TensorFlow's ``tf.keras`` tf_keras (tensorflow/__init__.py).
LEGACY_KERAS_VALUES = ("1", "true", "True")


def keras_module() -> ModuleType:
    """The Keras that ``tf.keras`` means here: tf_keras when ``TF_USE_LEGACY_KERAS`` holds a value TensorFlow
    takes for yes (1, true, True: ``yes`` or ``TRUE`` leave TensorFlow on Keras 3), else Keras 3."""
    if os.environ.get("TF_USE_LEGACY_KERAS") in LEGACY_KERAS_VALUES:
        import tf_keras  # noqa: PLC0415

        return tf_keras
    import keras  # noqa: PLC0415

    return keras


def task_index() -> int:
    """This worker's index in ``TF_CONFIG`` (0 when there is none: a single worker).

    The chief, if the cluster has one, comes first: it is worker 0 and "worker" task i is worker i + 1.
    """
    tf_config = _tf_config()
    task = tf_config.get("task", {})
    if task.get("type", "worker") not in ("worker", "chief"):
        raise ConfigError(f"TF_CONFIG task type {task.get('type')!r} is not a training worker")
    chiefs = len(_cluster(tf_config).get("chief", [])) if task.get("type", "worker") == "worker" else 0
    return chiefs + int(task.get("index", 0))


def _cluster(tf_config: dict[str, Any]) -> dict[str, Any]:
    """TF_CONFIG's "cluster": task type -> addresses ({} when there is none)."""
    cluster = tf_config.get("cluster", {})
    if not isinstance(cluster, dict) or not all(isinstance(tasks, list) for tasks in cluster.values()):
        raise ConfigError(f'TF_CONFIG\'s "cluster" must map each task type to a list of addresses, as '
                          f'{{"worker": ["host:port", ...]}}, got {cluster!r:.80}')
    return cluster


def _tf_config() -> dict[str, Any]:
    """``TF_CONFIG`` parsed, or {} when it is not set."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"TF_CONFIG must be a JSON object, got {type(parsed).__name__}")
    return parsed


def training_tasks() -> int | None:
    """How many training workers (chief and workers) ``TF_CONFIG`` lists; None when it lists no cluster."""
    cluster = _cluster(_tf_config())
    return len(cluster.get("chief", [])) + len(cluster.get("worker", [])) if cluster else None


def require_tf_keras(job: str) -> None:
    """Raise unless ``tf.keras`` means tf_keras here (Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy)."""
    if keras_module().__name__ != "tf_keras":
        raise ConfigError("multi-worker training needs tf_keras: set TF_USE_LEGACY_KERAS=1 before importing "
                          "TensorFlow and build the model with tf.keras (or import tf_keras as keras), not `import "
                          "keras`, which stays Keras 3 (Keras 3's model.fit fails under MultiWorkerMirroredStrategy)",
                          job=job)


def device_label() -> str:
    """What this worker reports as its device: "gpu:<model>" for its first visible GPU, so that a joining
    worker's cold-start prior comes from workers with the same GPU model, else "cpu"."""
    import tensorflow as tf  # noqa: PLC0415

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu"
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "")
    return f"gpu:{name}"[:64] if name else "gpu"


#: What the StoreUnavailable of a Redis unusable past ``outage_s`` tells a Keras user to do (WorkerSession takes no
#: ``agree=``, which the core's message names).
_OUTAGE_HINT = ("bring Redis back (without url=, worker 0's embedded redis-server), or give WorkerSession a longer "
               "outage_s= (up to 86400 s) to ride out a longer outage")


class WorkerSession:
    """One worker's connection to its job: Redis, the coordinator (on worker 0) and a :class:`WorkerClient`.

    Without ``url``, worker 0 starts an embedded redis-server on a unix socket that the other workers on
    the same machine find from the job name. Given the ``MultiWorkerMirroredStrategy``, workers on other
    machines than worker 0's (:func:`lbbsp.embedded.machine_identity`) reach it over TCP instead, behind a random
    password that reaches them through the strategy's collectives; without it, pass a ``redis://`` URL on every
    worker.
    ``coordinator=False``: an external ``lbbsp coordinator`` serves the job on ``url`` instead of worker 0's; the
    session takes its lag and key TTL (``self.config``) and refuses a ``config`` whose other settings differ.
    A Redis that stays unusable is waited for up to ``outage_s``, then fit stops with StoreUnavailable (there
    is no agreed fallback under MWMS: see docs/keras.md, Agreement); the job's only worker trains on with its split
    meanwhile, without asking Redis until it answers again. ``max_ahead`` (16 by default) is worker 0's
    coordinator's: how many steps one decision may cover when deciding takes longer than a step; 1 decides every step.
    """

    def __init__(self, config: JobConfig, worker: int, *, url: str | None = None, policy: Policy | None = None,
                 strategy: Any = None, coordinator: bool = True, connect_timeout_s: float = 60.0,
                 outage_s: float | None = None, max_ahead: int | None = None) -> None:
        if not isinstance(config, JobConfig):
            raise ConfigError(f"config must be a JobConfig, e.g. JobConfig('run-1', num_workers=2, global_batch=256), "
                              f"got {type(config).__name__}")
        refused = _refusal(config, worker, url=url, policy=policy, coordinator=coordinator, max_ahead=max_ahead,
                           connect_timeout_s=connect_timeout_s, outage_s=outage_s)
        gather = _gatherer(strategy, config, worker, refused) if strategy is not None else None
        if refused is not None:  # (with a strategy, _gatherer has raised it, on every worker)
            raise refused
        self.config = config
        self.worker = worker = int(worker)
        self.server: EmbeddedRedis | None = None
        self.coordinator: CoordinatorProcess | None = None
        self.client: WorkerClient | None = None
        try:
            if url is not None:
                self.url = url
            elif gather is not None:
                start = functools.partial(_start_embedded, _embedded_directory(config.job))
                self.server, self.url = serve_embedded(worker, gather, start, toward=_worker0_host())
                log.info("worker %d reaches worker 0's embedded Redis at %s", worker, redacted(self.url))
            else:
                self.url = self._local_embedded()
            try:
                client = wait_for_redis(self.url, connect_timeout_s,
                                        socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
            except StoreUnavailable as exc:
                if url is None and strategy is None and worker != 0:  # (redis-py's reason ends with a period)
                    raise StoreUnavailable(f"{str(exc).rstrip('.')}. Worker 0 serves this job's Redis on that socket: "
                                           "on another machine than worker 0, pass strategy= (the "
                                           "MultiWorkerMirroredStrategy) or url=", job=config.job) from None
                raise
            if url is None and gather is None and worker != 0:  # worker 0's server, not one another user put there
                try:
                    check_private(_embedded_directory(config.job), socket="redis.sock")
                except ConfigError:
                    client.close()
                    raise
            store = Store(client, config.job, ttl_s=config.ttl_s, owns_client=True)
            if not coordinator:  # worker 0's reading, where the strategy can share it
                stored = agreed_config(store, worker, gather) if gather is not None else store.load_config()
                config = self.config = config.joined(stored, caller="WorkerSession's JobConfig", warn=worker == 0)
            elif worker == 0:
                self.coordinator = CoordinatorProcess(self.url, config, policy, max_ahead=checked_max_ahead(max_ahead))
            self.client = WorkerClient(store, config, worker, device=device_label(), outage_s=outage_s,
                                       outage_hint=_OUTAGE_HINT)
        except BaseException:
            self.close()
            raise
        _OPEN.add(self)

    def _local_embedded(self) -> str:
        """Worker 0 starts the embedded server on a unix socket in a folder named after the job, where the other
        workers on its machine find it; the socket's URL."""
        directory = _embedded_directory(self.config.job)
        if self.worker == 0:
            self.server = _start_embedded(directory)
        return f"unix://{quote(str(directory / 'redis.sock'))}"  # quoted as EmbeddedRedis.url is

    def close(self) -> None:
        """Stop the client, the coordinator and the embedded server that this session started; idempotent. With the
        session's own server, whose folder (its data) goes with it, neither waits on a Redis that stopped answering:
        worker 0 had exited 11-20 s after the other workers, in the coordinator's grace and the server's shutdown."""
        _OPEN.discard(self)
        if self.client is not None:
            self.client.close()
            self.client.store.close()
            self.client = None
        if self.coordinator is not None:
            if self.server is not None:  # its last writes (status rows, its claim) go to a server deleted next
                self.coordinator.stop(GRACE_BEFORE_OWN_SERVER_S)
            else:
                self.coordinator.stop()
            self.coordinator = None
        if self.server is not None:  # killed, its folder deleted (EmbeddedRedis.close): no wait on a stalled one
            self.server.close()
            self.server = None

    def __enter__(self) -> WorkerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: This process's WorkerSessions not closed yet (close_sessions); held, as their threads hold their servers anyway.
_OPEN: set[WorkerSession] = set()


def close_sessions(job: str | None = None) -> int:
    """Close this process's WorkerSessions that are still open (of ``job``, or all) and return how many: in a
    notebook, a session made outside ``with`` whose fit raised keeps its embedded Redis serving (its threads hold it),
    and a new session of its job name is refused until it is closed."""
    sessions = [s for s in list(_OPEN) if job is None or s.config.job == job]
    for session in sessions:
        session.close()
    return len(sessions)


def _start_embedded(directory: Path, listen: str | None = None) -> EmbeddedRedis:
    """Worker 0's embedded server in ``directory``: a fresh one (never another run's assignments), labelled so
    that a later start removes it if we are killed, and removed when it stops or fails to start (it holds the
    password's config file). A folder a server still answers in is another live session's of this job: refused."""
    if server_listening(directory / "redis.sock"):  # (False where there is no socket)
        own = [s.config.job for s in list(_OPEN) if s.server is not None and s.server.directory == directory]
        where = (f"on this machine, in this process (one made outside `with` whose run raised, in a notebook cell run "
                 f"again?): close it, or call lbbsp.integrations.keras.close_sessions({own[0]!r})," if own else
                 f"on this machine: its embedded Redis answers in {directory}, and a second one there would delete it "
                 "under that run. Close it,")
        raise ConfigError(f"another WorkerSession of this job name runs {where} or give this run another job name")
    remove_stale_folders(directory.parent)  # killed runs' folders beside it, as a start without a folder does
    shutil.rmtree(directory, ignore_errors=True)
    return EmbeddedRedis(directory, listen=listen, own_directory=True)


def _refusal(config: JobConfig, worker: int, *, url: str | None, policy: Policy | None, coordinator: bool,
             max_ahead: int | None, connect_timeout_s: float, outage_s: float | None) -> ConfigError | None:
    """What is wrong with this worker's own arguments (and TF_CONFIG), if anything."""
    if not _is_integer(worker) or not 0 <= int(worker) < config.num_workers:
        return ConfigError(f"worker must be this worker's index, an integer in [0, {config.num_workers}), got "
                           f"{worker!r}: pass task_index()", job=config.job)
    try:
        _flag(coordinator, "coordinator", config.job)  # "false" from a command line had started one
    except ConfigError as exc:
        return exc
    if url is not None and not isinstance(url, str):
        return ConfigError(f"url must be None (an embedded Redis) or a Redis URL string, got {url!r:.60}",
                           job=config.job)
    if not coordinator and url is None:
        return ConfigError("with an external coordinator (coordinator=False), pass url=, the URL of the Redis it "
                           "serves the job on: an embedded server here would be one it cannot see", job=config.job)
    if not coordinator and policy is not None:
        return ConfigError(EXTERNAL_POLICY, job=config.job)
    if not coordinator and max_ahead is not None:
        return ConfigError(EXTERNAL_MAX_AHEAD, job=config.job)
    try:
        checked_max_ahead(max_ahead, config.job)
        checked_process_policy(policy, config)  # on every worker: worker 0 alone would leave the others waiting
        _real(connect_timeout_s, "connect_timeout_s", 0.0, 86_400.0, "seconds in (0, 86400]", lo_open=True)
        checked_outage(outage_s, config)  # before Redis and the coordinator start, not after
    except ConfigError as exc:
        return exc
    tasks = training_tasks()
    if tasks is not None and tasks != config.num_workers:
        return ConfigError(f"TF_CONFIG lists {tasks} training workers but JobConfig.num_workers is "
                           f"{config.num_workers}", job=config.job)
    if tasks is not None and tasks > 1:
        try:
            require_tf_keras(config.job)
        except ConfigError as exc:
            return exc
    return None


def _gatherer(strategy: Any, config: JobConfig, worker: int,
              refused: ConfigError | None) -> Callable[[str | None], list[str | None]] | None:
    """An all-gather of one string (or None) per worker over ``strategy``'s collectives; None for a job of one
    worker. First, through it, every worker raises a ConfigError together where one of them ``refused`` its own
    arguments, the strategy does not span the job's workers, two of them share an index, or their JobConfigs
    differ (a job name that is not the same everywhere, say)."""
    if config.num_workers == 1:
        return None
    does_not_span = ConfigError(f"the strategy given does not span the job's {config.num_workers} workers: pass the "
                                "MultiWorkerMirroredStrategy that TF_CONFIG describes (or url=), or, for one process, "
                                "JobConfig(num_workers=1)", job=config.job)
    replicas = _replicas_per_worker(strategy)
    if replicas is None:
        raise does_not_span
    if _all_summed(strategy, replicas, np.array([float(refused is not None)], np.float32))[0]:
        raise refused or ConfigError("another worker refused its settings: see its error", job=config.job)
    workers = config.num_workers
    taken = _all_summed(strategy, replicas, np.eye(workers, dtype=np.float32)[worker])
    if taken.max() > 1:
        index = int(taken.argmax())
        raise ConfigError(f"{int(taken[index])} workers call themselves worker {index}: pass task_index(), which "
                          "counts a chief first", job=config.job)
    if taken.sum() != workers:
        raise does_not_span
    gather = functools.partial(all_gathered, strategy, replicas, workers, worker)
    ours = json.loads(config.to_json())
    for index, theirs in enumerate(json.loads(str(c)) for c in gather(config.to_json())):
        differ = [f"{name}={theirs[name]!r} against {value!r}" for name, value in ours.items() if theirs[name] != value]
        if differ:
            raise ConfigError(f"worker {index}'s JobConfig differs from worker {worker}'s: {', '.join(differ)}; "
                              "every worker must pass the same settings, job name included", job=config.job)
    return gather


def _replicas_per_worker(strategy: Any) -> int | None:
    """How many replicas each worker of ``strategy`` runs; None for what cannot reduce across workers (the default
    strategy has no devices of its own, and an object that is no strategy has no ``extended``)."""
    try:
        return len(strategy.extended.worker_devices)
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


def all_gathered(strategy: Any, replicas: int, workers: int, worker: int, value: str | None) -> list[str | None]:
    """Every worker's ``value``, in worker order: their UTF-8 bytes summed into a table over the strategy."""
    data = np.frombuffer(value.encode(), np.uint8) if value is not None else np.zeros(0, np.uint8)
    lengths = np.zeros(workers, np.float32)
    lengths[worker] = len(data) + 1 if value is not None else 0  # 0: None
    lengths = _all_summed(strategy, replicas, lengths)
    table = np.zeros((workers, max(1, int(lengths.max()))), np.float32)
    table[worker, :len(data)] = data
    table = _all_summed(strategy, replicas, table)
    return [bytes(table[i, :int(n) - 1].astype(np.uint8)).decode() if n else None for i, n in enumerate(lengths)]


def _all_summed(strategy: Any, replicas: int, array: np.ndarray) -> np.ndarray:
    """The sum of ``array`` over the workers of ``strategy``, each counted once whatever its ``replicas``."""
    import tensorflow as tf  # noqa: PLC0415

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(array if ctx.replica_id_in_sync_group % replicas == 0 else np.zeros_like(array)))
    return np.asarray(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None))


def _worker0_host() -> str | None:
    """The host of worker 0 (the chief, or else worker task 0) in ``TF_CONFIG``: the other workers reach it there."""
    cluster = _tf_config().get("cluster", {})
    tasks = cluster.get("chief") or cluster.get("worker") or [""]
    return str(tasks[0]).rsplit(":", 1)[0].strip("[]") or None


def _embedded_directory(job: str) -> Path:
    """Where worker 0's embedded server of ``job`` lives, so that the other local workers find its socket."""
    return Path(temp_parent()) / f"{FOLDER_PREFIX}keras-{os.getuid()}-{hashlib.sha1(job.encode()).hexdigest()[:16]}"
