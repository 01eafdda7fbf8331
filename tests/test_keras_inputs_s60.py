"""BalancedSource names what it cannot take as a new user passes it: a tf.data.Dataset had been "x must be a numeric
array with a sample axis, got shape () and dtype object", and a list of labels "y[0] must be a numeric array ... got
shape ()" (read as one output per label)."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import ConfigError
from lbbsp.integrations.keras import BalancedSource

X, Y = np.random.default_rng(0).random((100, 4)).astype("float32"), np.arange(100) % 2
CONFIG = JobConfig("inputs", num_workers=1, global_batch=32)


def test_a_dataset_or_an_iterator_is_named_as_such() -> None:
    import tensorflow as tf  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"x must be in-memory arrays \(numpy or tensors\), got a \w*Dataset"):
        BalancedSource(tf.data.Dataset.from_tensor_slices((X, Y)), None, CONFIG, 0)
    with pytest.raises(ConfigError, match="got a generator"):
        BalancedSource((row for row in X), Y, CONFIG, 0)
    assert len(BalancedSource(tf.constant(X), tf.constant(Y), CONFIG, 0)) == 4  # tensors are arrays


def test_a_list_of_labels_is_told_to_be_one_array() -> None:
    with pytest.raises(ConfigError, match=r"y is a list of 100 single values.*np.asarray\(y\)"):
        BalancedSource(X, list(Y), CONFIG, 0)
    assert len(BalancedSource(X, [Y], CONFIG, 0)) == 4  # a list of arrays: one per output, as before


def test_a_tuple_of_generators_is_named_as_generators() -> None:
    """Each part a generator had read as a single value ("a tuple of 2 single values ... pass np.asarray(x)")."""
    with pytest.raises(ConfigError, match=r"x\[0\] must be in-memory arrays .* got a generator"):
        BalancedSource(((row for row in X), (row for row in X)), Y, CONFIG, 0)
