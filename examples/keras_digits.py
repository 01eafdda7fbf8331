"""Train a small Keras MLP on scikit-learn's digits with LB-BSP.

    python examples/keras_digits.py                 # one worker, Keras 3 (or tf_keras with TF_USE_LEGACY_KERAS=1)
    python examples/keras_digits.py --workers 2     # two local tf_keras workers under MultiWorkerMirroredStrategy

With ``--workers N`` this script starts N copies of itself (``--index i``) with TF_CONFIG on free localhost
ports; worker 0 starts the embedded Redis and the coordinator, the others find it from the job name.

On several machines, set TF_CONFIG on each as for any MultiWorkerMirroredStrategy job, and the same job name:

    TF_USE_LEGACY_KERAS=1 python examples/keras_digits.py --job digits-1   # on every machine

No Redis to set up: worker 0's embedded server also listens on TCP, and its address and password reach the
other workers through the strategy.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

MIN_BATCH = 8  # no worker's batch below this: the global batch must hold it for every worker


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1, help="local worker processes to start")
    parser.add_argument("--index", type=int, default=None, help="(internal) run as this worker")
    parser.add_argument("--ports", default="", help="(internal) the workers' localhost ports")
    parser.add_argument("--job", default=None, help="job name (fresh per run by default)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
    parser.add_argument("--policy", choices=["lbbsp", "bsp"], default="lbbsp")
    parser.add_argument("--redis", default=None, help="Redis URL (default: embedded on worker 0)")
    parser.add_argument("--cpu", type=int, default=None, help="pin this worker to one CPU core")
    parser.add_argument("--result", default=None,
                        help="write this worker's figures as JSON here (with --workers N, worker i writes to F with "
                             ".i before its suffix: results.json gives results.0.json, results.1.json, ...)")
    args = parser.parse_args()
    if args.workers < 1 or args.epochs < 1:
        parser.error(f"--workers and --epochs must be at least 1, got {args.workers} and {args.epochs}")
    workers = len(args.ports.split(",")) if args.ports else args.workers  # a worker launch() started: all of them
    if args.global_batch < MIN_BATCH * workers:
        parser.error(f"--global-batch must be at least {MIN_BATCH} per worker ({MIN_BATCH * workers} for "
                     f"{workers}): each worker's batch is kept at {MIN_BATCH} or more")
    return args


def launch(args: argparse.Namespace) -> int:
    """Start ``args.workers`` local workers of this script and wait for them."""
    ports = []
    for _ in range(args.workers):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            ports.append(str(s.getsockname()[1]))
    job = args.job or f"digits-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1"}
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--workers")]
    if "--workers" in sys.argv:
        at = sys.argv.index("--workers")
        passthrough = sys.argv[1:at] + sys.argv[at + 2:]
    def own_result(i: int) -> list[str]:  # the last --result given is the one argparse keeps
        if not args.result:
            return []
        path = Path(args.result)
        return ["--result", str(path.with_name(f"{path.stem}.{i}{path.suffix}"))]

    procs = [subprocess.Popen([sys.executable, __file__, *passthrough, *own_result(i), "--index", str(i), "--ports",
                               ",".join(ports), "--job", job], env=env) for i in range(args.workers)]
    try:
        return _wait(procs)
    finally:  # the launcher stopped (Ctrl-C, SIGTERM) or a worker failed: no worker outlives it
        _stop(procs)


def _wait(procs: list[subprocess.Popen[bytes]]) -> int:
    """The workers' exit code: the first failure's (the others are stopped: under MultiWorkerMirroredStrategy they
    would wait for the failed one's collectives), else 0. SIGTERM and SIGHUP end the wait as Ctrl-C does."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, stop)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            worker, code = failed[0]
            print(f"worker {worker} exited with {code}: stopping the others", file=sys.stderr)
            return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM to the workers still running, then SIGKILL to those left after ``grace_s`` (TensorFlow's coordination
    service catches SIGTERM, and such a worker had kept running after its launcher was killed)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def train(args: argparse.Namespace) -> None:
    """One worker: load digits, build the model, fit with the lbbsp callback and data source."""
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.result:  # its folder before training, not a FileNotFoundError after it
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    if args.ports:  # started by launch(); otherwise TF_CONFIG, where set, is the user's
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in args.ports.split(",")]},
                                              "task": {"type": "worker", "index": args.index}})
    import tensorflow as tf  # noqa: PLC0415  (TensorFlow reads TF_CONFIG when it loads, so only after it is set)
    from sklearn.datasets import load_digits  # noqa: PLC0415

    from lbbsp import BSPPolicy, JobConfig, LBBSPPolicy  # noqa: PLC0415
    from lbbsp.integrations.keras import (  # noqa: PLC0415
        BalancedSource,
        LBBSPCallback,
        WorkerSession,
        keras_module,
        task_index,
        training_tasks,
    )

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras = keras_module()
    workers = training_tasks() or 1
    index = task_index()
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if workers > 1 else tf.distribute.get_strategy()

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    config = JobConfig(args.job or f"digits-{uuid.uuid4().hex[:8]}", num_workers=workers,
                       global_batch=args.global_batch, min_batch=MIN_BATCH)
    policy = LBBSPPolicy() if args.policy == "lbbsp" else BSPPolicy()
    with WorkerSession(config, index, url=args.redis, policy=policy, strategy=strategy) as session:
        source = BalancedSource(x, y, config, index, seed=0)
        with strategy.scope():
            model = keras.Sequential([keras.layers.Input((64,)),
                                      keras.layers.Dense(args.hidden, activation="relu"),
                                      keras.layers.Dense(args.hidden, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callback = LBBSPCallback(session.client, source)
        started = time.perf_counter()
        history = model.fit(source.tf_dataset(strategy), epochs=args.epochs, steps_per_epoch=len(source),
                            shuffle=False, callbacks=[callback], verbose=2 if index == 0 else 0)
        elapsed = time.perf_counter() - started
        trained = sum(b.size for b in source.served)
        trained_globally = sum(source.sampler.batch_size(b.step) for b in source.served)  # every worker's samples
        last = source.served[-1]  # an epoch's short final batch uses its vector scaled down
        used = source.sampler.split_for(last.step, last.sizes)
        short = f" (the epoch's short final batch: {used})" if used != tuple(last.sizes) else ""
        print(f"worker {index}: {trained} samples in {elapsed:.1f}s, last agreed split {last.sizes}{short}, "
              f"final loss {history.history['loss'][-1]:.4f}", flush=True)
        if args.result:
            with open(args.result, "w") as out:
                json.dump({"worker": index, "seconds": elapsed, "samples": trained, "steps": callback.iteration,
                           "global_samples_per_s": trained_globally / elapsed,
                           "sizes": [list(b.sizes) for b in source.served]}, out)


def main() -> int:
    args = parse_args()
    if args.job is None and args.index is None and os.environ.get("TF_CONFIG"):
        sys.exit("with a TF_CONFIG of your own, pass --job NAME, the same on every worker")
    if args.index is None and args.workers > 1:
        return launch(args)
    from lbbsp import ConfigError, StoreUnavailable  # noqa: PLC0415  (as train's imports: after TF_CONFIG is set)

    try:
        train(args)
    except (ConfigError, StoreUnavailable) as exc:  # a bad or unreachable --redis: why, not a page of traceback
        sys.exit(f"keras_digits.py: {exc}{' (from --redis)' if isinstance(exc, StoreUnavailable) and args.redis else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
