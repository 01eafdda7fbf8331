"""Two real tf_keras workers under MultiWorkerMirroredStrategy, resized every step by a real coordinator.

Run by pytest, this file starts itself twice as ``python tests/test_keras_mwms.py worker ...``: two TF
processes on localhost ports, worker 0 running the coordinator in-process, both on the test's embedded Redis.
The coordinator uses a scripted policy, so the splits are uneven and change every iteration.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from lbbsp import Assignment, JobConfig, Store, scale_split
from lbbsp.policies import Decision, Policy

GLOBAL_BATCH = 16
SAMPLES = 100  # 6 full global batches and a short one of 4: the short split is scaled too
EPOCHS = 2
SEED = 3
SPLITS = [(3, 13), (11, 5), (8, 8), (13, 3), (5, 11), (1, 15)]


class ScriptedPolicy(Policy):
    """Uneven splits that change every iteration, independent of timing, so the test is deterministic."""

    name = "scripted"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(SPLITS[iteration % len(SPLITS)], f"scripted split {iteration % len(SPLITS)}")


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, 5))
    y = np.tanh(x @ rng.normal(size=(5, 2))) + 0.1 * rng.normal(size=(SAMPLES, 2))
    return x, y


def build_model(keras):  # type: ignore[no-untyped-def]
    return keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


def run_worker(index: int, ports: list[int], url: str, job: str, steps_per_execution: int, out: Path) -> None:
    """One MWMS worker: fit with the lbbsp callback and data source, then save weights and what it served."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": index}})
    import tensorflow as tf  # noqa: PLC0415

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import tf_keras as keras  # noqa: PLC0415

    from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession, task_index  # noqa: PLC0415

    keras.backend.set_floatx("float64")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = JobConfig(job, num_workers=2, global_batch=GLOBAL_BATCH, assignment_timeout_s=30.0)
    x, y = make_data()
    with WorkerSession(config, task_index(), url=url, policy=ScriptedPolicy()) as session:
        source = BalancedSource(x, y, config, session.worker, seed=SEED, steps_per_execution=steps_per_execution)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = build_model(keras)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=steps_per_execution)
        initial = [w.copy() for w in model.get_weights()]
        callback = LBBSPCallback(session.client, source)
        traces: list[int] = []
        count_traces = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda *_: traces.append(model.train_function.experimental_get_tracing_count()))
        model.fit(source.tf_dataset(strategy), epochs=EPOCHS, steps_per_epoch=len(source),
                  callbacks=[callback, count_traces], verbose=0)
        np.savez(out / f"weights{index}.npz", *model.get_weights())
        np.savez(out / f"initial{index}.npz", *initial)
        served = [[b.iteration, b.epoch, b.step, b.size] for b in source.served]
        (out / f"served{index}.json").write_text(json.dumps({
            "served": served, "iterations": callback.iteration, "traces": traces,
            "probed": callback.probe is not None}))


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _reference_weights(initial: list[np.ndarray]) -> list[np.ndarray]:
    """A single-process tf_keras run on the same global batches, in the same order."""
    import tensorflow as tf  # noqa: PLC0415
    import tf_keras as keras  # noqa: PLC0415

    from lbbsp import GlobalBatchSampler  # noqa: PLC0415

    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.backend.set_floatx("float64")
    model = build_model(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.set_weights(initial)
    x, y = make_data()
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            idx = sampler.global_indices(step)
            model.train_on_batch(x[idx], y[idx])
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_two_workers_resize_and_match_single_process(tmp_path: Path, redis_url: str, job: str,
                                                     steps_per_execution: int) -> None:
    ports = _free_ports(2)
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(i), ",".join(map(str, ports)), redis_url, job,
                               str(steps_per_execution), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]

    store = Store.from_url(redis_url, job)
    records = [json.loads((tmp_path / f"served{i}.json").read_text()) for i in range(2)]
    iterations = EPOCHS * -(-7 // steps_per_execution)
    assert [r["iterations"] for r in records] == [iterations, iterations]
    # Traced in the first epoch (twice: once more after creating the optimizer's variables), never again for
    # the new sizes of the second epoch.
    assert all(r["traces"][0] == r["traces"][-1] and r["probed"] for r in records), records
    used_sizes = set()
    for worker, record in enumerate(records):
        assert len(record["served"]) == EPOCHS * 7
        for iteration, _epoch, step, size in record["served"]:
            agreed = Assignment.from_json(store.get_assignment(iteration), job=job, num_workers=2,
                                          global_batch=GLOBAL_BATCH)
            total = GLOBAL_BATCH if step < 6 else SAMPLES - 6 * GLOBAL_BATCH
            assert size == scale_split(agreed.sizes, total)[worker], (worker, iteration, step)
            used_sizes.add(agreed.sizes)
    assert len(used_sizes) >= 4  # the splits really changed
    store.close()

    weights = [list(np.load(tmp_path / f"weights{i}.npz").values()) for i in range(2)]
    initial = list(np.load(tmp_path / "initial0.npz").values())
    reference = _reference_weights(initial)
    for a, b, ref in zip(weights[0], weights[1], reference):
        np.testing.assert_array_equal(a, b)  # MWMS keeps the replicas identical
        # float64 throughout: the only difference is the order of the floating-point sums (per-worker partial
        # sums, then the all-reduce), about 1e-16 per step; 1e-10 leaves room for 14 steps of it.
        np.testing.assert_allclose(a, ref, rtol=1e-10, atol=1e-12)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _, _, index, ports, url, job, spe, out = sys.argv
    run_worker(int(index), [int(p) for p in ports.split(",")], url, job, int(spe), Path(out))
