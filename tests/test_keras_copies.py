"""Copies of the Keras integration's objects, with a real embedded Redis, a real coordinator process and Keras 3's
model.fit: a callbacks list deep-copied for a second fit (as KerasTuner copies it for each trial) trains on as the
same worker, carrying on the job's iterations; the source, and a callback pickled, refuse with lbbsp's ConfigError,
not pickle's "cannot pickle '_thread.lock' object"."""
from __future__ import annotations

import copy
import os
import pickle

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import ConfigError

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

if keras.__version__.startswith("2") or os.environ.get("TF_USE_LEGACY_KERAS"):
    pytest.skip("these tests are for Keras 3", allow_module_level=True)
try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
except RuntimeError:  # TF already initialised by another test module
    pass

from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession  # noqa: E402


@pytest.mark.timeout(120)
def test_a_deep_copied_callback_trains_on_as_the_same_worker_and_live_objects_refuse_pickling(
        redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, seed=1)
        callbacks = [LBBSPCallback(session.client, source), keras.callbacks.History()]
        for trial in range(2):  # KerasTuner: a new model and a deep copy of the callbacks for each trial
            keras.utils.set_random_seed(trial)
            model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
            copied = copy.deepcopy(callbacks)  # had raised TypeError: cannot pickle '_thread.lock' object
            assert copied[0].client is session.client and copied[0].source is source
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=copied, verbose=0,
                      shuffle=False)
        assert copied[0].iteration == 2 * len(source)  # the second trial carried on the job's iterations
        assert [b.iteration for b in source.served] == list(range(2 * len(source)))  # each once, in order
        for what in (callbacks[0], source):
            with pytest.raises(ConfigError, match="cannot be (copied or )?pickled"):
                pickle.dumps(what)
        with pytest.raises(ConfigError, match="BalancedSource cannot be copied or pickled"):
            copy.deepcopy(source)
