"""The Keras integration when something fails or stops: worker 0 closing beside its stalled embedded Redis, a fit that
raised leaving no prefetch thread to hang or stall the process, a Redis outage during fit (ridden out, or fit ended
at outage_s), a connect timeout that holds, and examples/keras_digits.py's launcher stopped with SIGTERM."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from lbbsp import EmbeddedRedis, JobConfig
from lbbsp.coordinator_process import CoordinatorProcess
from lbbsp.errors import StoreUnavailable

tf = pytest.importorskip("tensorflow")
tf_keras = pytest.importorskip("tf_keras")
from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession, keras_module  # noqa: E402
from test_keras_usage import _RAISE_IN_FIT  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker0_closes_without_waiting_on_its_stalled_embedded_redis(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    graces: list[float] = []
    kills: list[bool] = []
    stop_coordinator, stop_server = CoordinatorProcess.stop, EmbeddedRedis.stop

    def coordinator_stopped(self: CoordinatorProcess, timeout_s: float = 5.0) -> None:
        graces.append(timeout_s)
        stop_coordinator(self, timeout_s)

    def server_stopped(self: EmbeddedRedis, *, kill: bool = False) -> None:
        kills.append(kill)
        stop_server(self, kill=kill)

    monkeypatch.setattr(CoordinatorProcess, "stop", coordinator_stopped)
    monkeypatch.setattr(EmbeddedRedis, "stop", server_stopped)
    session = WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 0)
    assert session.server is not None and session.coordinator is not None
    server: Any = session.server._process
    child = session.coordinator._process
    folder = session.server.directory
    os.kill(server.pid, signal.SIGSTOP)  # the coordinator's next Redis call now lasts its socket timeout
    try:
        session.close()
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
            server.wait()
    # the coordinator's child got a short grace, and was killed inside its Redis call (it could not end by itself)
    assert len(graces) == 1 and graces[0] <= 2.0, graces
    assert child.exitcode == -signal.SIGKILL
    # the server was killed outright, not sent SIGTERM (which a stalled server leaves pending) and waited for
    assert kills and kills[0] is True, kills
    assert server.returncode == -signal.SIGKILL
    assert not folder.exists()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_fit_that_raised_leaves_no_prefetch_thread_to_hang_the_exit(redis_url: str, job: str) -> None:
    """Keras 3 from a tf_dataset: tf.data's injected prefetch thread waited in the generator for the next vector,
    and the GC at exit destroyed the iterator and waited for that thread forever (often, not always: 3 tries)."""
    pytest.importorskip("keras", minversion="3")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"} | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    for attempt in range(3):
        try:
            done = subprocess.run([sys.executable, "-c", _RAISE_IN_FIT, redis_url, f"{job}-{attempt}"], env=env,
                                  capture_output=True, text=True, timeout=150, check=False)
        except subprocess.TimeoutExpired:  # TensorFlow's import and the fit alone took 40-50 s on a loaded machine
            pytest.fail(f"the process hung at exit after a fit that raised (try {attempt + 1})")
        assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-2000:]
        assert float(done.stdout.split("released after ")[1].rstrip().rstrip("s")) < 10, done.stdout


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"


def _workers_of(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children() if "--index" in p.cmdline()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launcher_stopped_with_sigterm_stops_its_workers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "LBBSP_"))}
    launcher = subprocess.Popen([sys.executable, str(EXAMPLE), "--workers", "2", "--epochs", "1000"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        parent = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 60
        while len(workers := _workers_of(parent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2
        time.sleep(15)  # into training: TensorFlow's coordination service holds SIGTERM by now
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:  # the launcher and its workers share a process group of their own
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()


keras = keras_module()


def _model() -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    return model


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(n, 6)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


class Stall(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """Stops the session's redis-server (SIGSTOP) after step ``at``, lets it go on (SIGCONT) ``resume_s`` later if
    given, times every step after the stall, and ends the fit ``give_up_s`` into it (as a guard: a fit that never
    ends)."""

    def __init__(self, pid: int, at: int, *, resume_s: float | None = None, give_up_s: float = 20.0) -> None:
        super().__init__()
        self.pid, self.at, self.resume_s, self.give_up_s = pid, at, resume_s, give_up_s
        self.step = 0
        self.stalled: float | None = None
        self.resumed = False
        self.steps: list[float] = []  # each step's wall time after the stall (its batch hooks included)
        self._began = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._began = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.monotonic()
        if self.stalled is not None:
            self.steps.append(now - self._began)
            if self.resume_s is not None and not self.resumed and now - self.stalled >= self.resume_s:
                os.kill(self.pid, signal.SIGCONT)
                self.resumed = True
            if now - self.stalled > self.give_up_s:
                self.model.stop_training = True
        self.step += 1
        if self.step == self.at:
            os.kill(self.pid, signal.SIGSTOP)
            self.stalled = time.monotonic()


@pytest.fixture
def session(job: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerSession]:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = JobConfig(job, num_workers=1, global_batch=16, assignment_timeout_s=1.0)
    with WorkerSession(config, 0, outage_s=4.0) as own:
        assert own.server is not None and own.server.pid is not None
        pid = own.server.pid
        try:
            yield own
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_worker_trains_on_through_a_stalled_redis_and_fit_ends_at_outage_s(session: WorkerSession) -> None:
    """Before: the lone worker fell back at every step but asked the stalled Redis each time (three socket timeouts,
    1 s a step here, 5-10 s with the defaults, where a step takes 15 ms), and WorkerSession(outage_s=...) did nothing:
    fit never ended. Now the steps after the first do not ask Redis, and fit ends with StoreUnavailable about outage_s
    into the stall, with a hint a Keras user can follow (WorkerSession takes no agree=)."""
    x, y = _data(160)
    assert session.client is not None
    source = BalancedSource(x, y, session.config, session.worker, seed=0)
    assert session.server is not None and session.server.pid is not None
    stall = Stall(session.server.pid, at=3)
    model = _model()
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        model.fit(source.tf_dataset(), epochs=500, steps_per_epoch=len(source), shuffle=False, verbose=0,
                  callbacks=[LBBSPCallback(session.client, source), stall])
    assert stall.stalled is not None, "the fit ended before the stall"
    ended = time.monotonic() - stall.stalled
    message = str(caught.value)
    assert 4.0 <= ended <= 7.0, (ended, time.monotonic() - began, message)
    assert "WorkerSession a longer outage_s=" in message and "agree=" not in message, message
    slow = [t for t in stall.steps if t > 0.2]
    assert len(slow) <= 1, f"{len(slow)} of {len(stall.steps)} steps waited on the stalled Redis: {slow[:5]}"
    assert len(stall.steps) >= 20, stall.steps
    # every step trained a whole global batch, each iteration once
    served = [(b.iteration, b.size) for b in source.served]
    assert len({k for k, _ in served}) == len(served) and {s for _, s in served} == {16}, served[:5]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_worker_rides_out_a_short_stall_and_trains_every_sample_once(session: WorkerSession) -> None:
    """A stall shorter than outage_s: the steps meanwhile do not wait on Redis, Redis is asked again once it answers,
    fit ends normally, and every sample of every epoch is trained once."""
    x, y = _data(160)
    assert session.client is not None and session.server is not None and session.server.pid is not None
    source = BalancedSource(x, y, session.config, session.worker, seed=0)
    stall = Stall(session.server.pid, at=3, resume_s=1.5)
    epochs = 150
    model = _model()
    model.fit(source.tf_dataset(), epochs=epochs, steps_per_epoch=len(source), shuffle=False, verbose=0,
              callbacks=[LBBSPCallback(session.client, source), stall])
    assert stall.resumed
    assert len([t for t in stall.steps if t > 0.2]) <= 2, stall.steps
    assert sum(b.size for b in source.served) == len(x) * epochs
    for epoch in range(epochs):
        assert sum(b.size for b in source.served if b.epoch == epoch) == len(x), epoch
    iterations = [b.iteration for b in source.served]
    assert iterations == list(range(len(iterations)))
    last = session.client.assignment(iterations[-1])  # from Redis again, not this worker's fallback
    assert not last.reason.startswith("Redis unusable"), last


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_multi_worker_error_names_what_a_keras_user_can_do(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: with several workers, the StoreUnavailable raised after outage_s ended 'bring Redis back, or give
    WorkerClient agree=', which a WorkerSession user cannot give. Now it names WorkerSession's outage_s, and no agree."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = JobConfig(job, num_workers=2, global_batch=16, assignment_timeout_s=1.0)
    with WorkerSession(config, 0, outage_s=1.0) as two:
        assert two.client is not None and two.server is not None and two.server.pid is not None
        pid = two.server.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                two.client.assignment(5)
            waited = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
    message = str(caught.value)
    assert waited < 4.0, waited
    assert "cannot fall back safely" in message and "WorkerSession a longer outage_s=" in message, message
    assert "agree" not in message, message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_connect_timeout_s_holds_against_a_server_that_never_answers(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: WorkerSession(connect_timeout_s=1) against an endpoint that accepts and never answers raised after
    10.1 s (a ping at a 3.3 s socket timeout with two retries), saying 'did not answer within 1s'."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel accepts the connections; nothing ever answers
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 1s"):
            WorkerSession(JobConfig(job, num_workers=1, global_batch=8), 0, url=url, connect_timeout_s=1)
        waited = time.monotonic() - began
    assert waited < 2.0, waited


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("legacy", [False, True])
def test_a_py_dataset_fit_that_raised_leaves_no_prefetch_to_stall_the_process(redis_url: str, job: str,
                                                                            legacy: bool) -> None:
    """``py_dataset()`` with one worker thread (the default): Keras reads it through a tf.data prefetch, whose thread
    waited in the source for the vector of the next step, which never came since fit had raised. Destroying fit's
    iterator, at the end of the ``except`` block or in the GC, waited for that thread: the process stood still for
    ``wait_timeout_s`` (120 s by default)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"} | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", _RAISE_IN_FIT, redis_url, job, "py_dataset"],
                          env=env | ({"TF_USE_LEGACY_KERAS": "1"} if legacy else {}), capture_output=True, text=True,
                          timeout=150, check=False)
    assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-2000:]
    assert float(done.stdout.split("released after ")[1].rstrip().rstrip("s")) < 10, done.stdout


@pytest.mark.timeout(120)
def test_worker_0s_start_removes_the_embedded_folders_of_killed_keras_runs(job: str) -> None:
    """Worker 0's embedded Redis lives in a folder named after the job, and only a start with no folder given removed
    killed runs' folders: a worker 0 killed (SIGKILL, or its launcher's SIGTERM) left its folder in /dev/shm for good,
    a few MB each, on a machine that ran Keras jobs alone."""
    script = ("import os, sys, time\nfrom lbbsp import JobConfig\nfrom lbbsp.integrations.keras import WorkerSession\n"
              "session = WorkerSession(JobConfig(sys.argv[1], num_workers=1, global_batch=32), 0)\n"
              "print(session.server.directory, session.server.pid, flush=True)\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script, f"{job}-killed"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        folder_text, server_pid = child.stdout.readline().split()
        folder = Path(folder_text)
        assert folder.is_dir()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(int(server_pid)).wait(timeout=30)  # the server ends with its parent
    assert folder.is_dir()  # no cleanup ran in the killed process
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=32), 0) as session:
        assert session.server is not None and session.server.directory.parent == folder.parent
        assert not folder.exists()
