"""Review of sampling, fedagg, telemetry and sim/traces: huge and odd values must not break exactness silently."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lbbsp import ConfigError, GlobalBatchSampler, scale_split
from lbbsp.fedagg import rescale_update
from lbbsp.sim.traces import TRACE_FEATURES, CPUTrace


def test_numpy_sizes_that_wrap_past_the_sum_check_are_refused() -> None:
    """int64 sizes summed in numpy wrapped round to B: worker 0 took the whole batch, worker 2 none of its 10."""
    sampler = GlobalBatchSampler(8, 8, shuffle=False)
    sizes = (np.int64(2**63 - 1), np.int64(2**63 - 1), np.int64(10))
    with pytest.raises(ConfigError, match="not the global batch 8"):
        sampler.worker_indices(0, sizes, 0)


def test_scale_split_is_exact_for_huge_sizes() -> None:
    """int64 products overflowed: (2**40, 2**40) scaled to 2**30 gave (1, 1); beyond int64, a raw OverflowError."""
    assert scale_split((2**40, 2**40), 2**30) == (2**29, 2**29)
    assert scale_split((2**70,), 5) == (5,)
    assert scale_split((3, 5), 2**70) == (3 * 2**67, 5 * 2**67)


def test_scale_split_breaks_ties_to_the_lower_index() -> None:
    """Workers 0 and 2 have equal remainders (2356/4123); float rounding gave the spare sample to worker 2."""
    sizes = (1957, 1539, 627)
    assert scale_split(sizes, 1240) == (589, 463, 188)
    sampler = GlobalBatchSampler(sum(sizes) + 1240, sum(sizes), shuffle=False)  # a short final batch of 1240
    assert sampler.split_for(1, sizes) == (589, 463, 188)
    parts = [sampler.worker_indices(1, sizes, w) for w in range(3)]
    assert np.concatenate(parts).tolist() == list(range(sum(sizes), sum(sizes) + 1240))


@pytest.mark.parametrize(("dtype", "before", "after", "scale", "want"), [
    (np.uint8, 1, 0, 2.0, 0),  # gave 255: -1 cast to uint8
    (np.int8, -100, -120, 2.0, -128),  # gave 116: -140 cast to int8
    (np.bool_, True, False, 2.5, False),  # gave True: -2 cast to bool, the client's change reversed
    (np.uint16, 65000, 65500, 2.0, 65535),  # gave 464: 66000 cast to uint16
])
def test_stretched_integer_and_bool_arrays_saturate(dtype: type, before: int, after: int, scale: float,
                                                    want: int) -> None:
    """A FedNova scale above 1 stretches an update past the dtype's range: it must stop at the range, not wrap."""
    (out,) = rescale_update([np.array([before], dtype=dtype)], [np.array([after], dtype=dtype)], scale)
    assert out.dtype == np.dtype(dtype) and out.tolist() == [want]


def test_a_stretched_int64_stops_below_its_top() -> None:
    """2**63 - 1 is 2**63 as a float, one past int64: the cast gave -2**63."""
    (out,) = rescale_update([np.zeros(1, dtype=np.int64)], [np.full(1, 2**62, dtype=np.int64)], 4.0)
    assert out.dtype == np.int64 and 2**63 - 2**11 <= int(out[0]) < 2**63


def test_a_hog_level_beyond_an_integer_is_refused(tmp_path: Path) -> None:
    """A hog_level of 1e300 passed as a whole number >= 0, then loaded as -2**63."""
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"columns": ["throughput", "hog_level", *TRACE_FEATURES],
                                "rows": [[1.0, 1e300, 0.5, 0.5, 0.1, 0.5, 4.0]]}))
    with pytest.raises(ConfigError, match="hog_level"):
        CPUTrace.load(path)
