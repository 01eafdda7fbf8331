"""One worker in one process: compute is timed without the wait inside gradient aggregation, whatever the
optimizer; a fit that raised leaves no prefetch that stalls the process; and a callback made before an earlier fit
carries on from where that fit left the job.

Under MultiWorkerMirroredStrategy the all-reduce in the step waits for the slowest worker. The callback leaves that
wait out of the reported compute with time marks around the optimizer's gradient aggregation. Here a sleep inside
the aggregation stands in for that wait.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from lbbsp import JobConfig

tf = pytest.importorskip("tensorflow")
tf_keras = pytest.importorskip("tf_keras")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class  # noqa: E402
from test_keras_fixes import _RAISE_IN_FIT  # noqa: E402

SAMPLES, GLOBAL_BATCH = 96, 32  # 3 steps per epoch
WAIT_S = 0.3  # the stand-in for the all-reduce's wait for a slower worker


def _waiting(aggregate: Any) -> Any:
    """``aggregate`` (grads_and_vars -> grads_and_vars), after sleeping WAIT_S inside the step, as an all-reduce
    that waits for a slower worker does."""
    def aggregate_after_a_wait(grads_and_vars: Any) -> Any:
        grads, variables = zip(*grads_and_vars)
        with tf.control_dependencies(grads):
            slept = tf.py_function(lambda: time.sleep(WAIT_S) or 0.0, [], tf.float32)
        with tf.control_dependencies([slept]):
            grads = [tf.identity(g) for g in grads]
        return aggregate(list(zip(grads, variables)))

    return aggregate_after_a_wait


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["SGD", "legacy.SGD"])
def test_the_wait_in_gradient_aggregation_is_not_reported_as_compute(redis_url: str, job: str, optimizer: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """tf_keras's legacy optimizers (tf_keras.optimizers.legacy) aggregate in ``_aggregate_gradients``, not in
    ``aggregate_gradients``: the probe was left out, and every report counted the all-reduce's wait as compute."""
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x = np.random.default_rng(0).normal(size=(SAMPLES, 6)).astype("float32")
    reports: list[tuple[float, float]] = []
    with WorkerSession(config, 0, url=redis_url) as session:
        send = session.client.report

        def record(iteration: int, samples: int, compute_s: float, **kwargs: Any) -> None:
            reports.append((compute_s, kwargs.get("wait_s") or 0.0))
            send(iteration, samples, compute_s, **kwargs)

        monkeypatch.setattr(session.client, "report", record)
        source = BalancedSource(x, x[:, :1], config, 0)
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Input((6,)), tf_keras.layers.Dense(1)])
        sgd = tf_keras.optimizers.legacy.SGD(0.01) if optimizer == "legacy.SGD" else tf_keras.optimizers.SGD(0.01)
        model.compile(optimizer=sgd, loss="mse")
        name = "_aggregate_gradients" if optimizer == "legacy.SGD" else "aggregate_gradients"
        setattr(sgd, name, _waiting(getattr(sgd, name)))
        model.fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), verbose=0,
                  callbacks=[callback_class(tf_keras)(session.client, source)])
    assert len(reports) == 2 * len(source)
    for compute_s, wait_s in reports[1:]:  # the first step traces the train function
        assert compute_s < WAIT_S / 2 and wait_s >= 0.9 * WAIT_S, reports


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_callbacks_made_before_an_earlier_fit_carry_on_its_iterations_and_epochs(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Callback lists built up front, one per fit: the second callback took the iteration and epoch reached when it
    was made (0), so its fit replayed the first fit's vectors and epoch 0's order, and Redis refused every report."""
    caplog.set_level(logging.WARNING)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x = np.random.default_rng(0).normal(size=(SAMPLES, 6)).astype("float32")
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, x[:, :1], config, 0)
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Input((6,)), tf_keras.layers.Dense(1)])
        model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss="mse")
        callbacks = [callback_class(tf_keras)(session.client, source) for _ in range(2)]
        for callback in callbacks:
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=[callback], verbose=0)
        session.client.flush()
    steps = len(source)
    assert [b.iteration for b in source.served] == list(range(2 * steps))
    assert [b.epoch for b in source.served] == [0] * steps + [1] * steps
    assert not [r for r in caplog.records if "reported already" in r.getMessage()]
