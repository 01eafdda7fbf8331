"""A Redis outage during Keras ``model.fit`` (real TensorFlow, the session's own embedded redis-server stopped with
SIGSTOP mid-fit), and ``WorkerSession``'s connect timeout against a server that accepts and never answers."""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import StoreUnavailable

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession, keras_module

keras = keras_module()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


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
