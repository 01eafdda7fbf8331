"""Weighted aggregation (lbbsp.fedagg): the weights b_i / B of the workers' sample counts and FedNova's rescaled
updates; counts, scales and arrays of other shapes refused, and integer and bool arrays stretched without wrapping."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lbbsp.errors import LBBSPError
from lbbsp.fedagg import fednova, fednova_scales, rescale_update, sample_weights

pytest.importorskip("flwr")
from lbbsp.fedagg import weighted_average


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


@pytest.mark.parametrize(("counts", "words"), [
    (["10", 5], r"sample count 0 .*'10' \(str\)"),  # np.asarray(..., dtype=float) read "10" as 10.0
    ([5, np.str_("10")], r"sample count 1 .*'10'.* \(str_\)"),
    ([5, b"10"], r"sample count 1 .*b'10' \(bytes\)"),
    ([3, None], r"sample count 1 .*None"),
])
def test_sample_counts_that_are_not_numbers_are_refused_by_index(counts: list[Any], words: str) -> None:
    with pytest.raises(LBBSPError, match=words):
        sample_weights(counts)


def test_numpy_counts_and_plain_numbers_still_weigh() -> None:
    np.testing.assert_allclose(sample_weights([np.int64(10), np.int32(30)]), [0.25, 0.75])
    np.testing.assert_allclose(sample_weights(np.array([1, 3], dtype=np.uint16)), [0.25, 0.75])
    np.testing.assert_allclose(sample_weights([2.5, np.float32(7.5)]), [0.25, 0.75])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), -0.5, 0.0, "2", None, True,
                                   np.float64("nan")])
def test_a_scale_that_is_not_a_positive_finite_stretch_is_refused(scale: Any) -> None:
    """NaN spoilt the model silently, -0.5 reversed the update, 0 dropped it, True stretched by 1."""
    with pytest.raises(LBBSPError, match=r"scale must be a finite number > 0"):
        rescale_update([np.zeros(2)], [np.ones(2)], scale)


def test_a_numpy_scale_still_stretches() -> None:
    np.testing.assert_allclose(rescale_update([np.zeros(2)], [np.ones(2)], np.float32(1.5))[0], [1.5, 1.5])


def test_the_aggregation_maths_refuse_arrays_of_other_shapes() -> None:
    with pytest.raises(LBBSPError, match="shape"):
        rescale_update([np.zeros(3)], [np.ones(1)], 2.0)  # numpy would broadcast the (1,) silently
    with pytest.raises(LBBSPError, match="shape"):
        rescale_update([np.zeros((2, 3))], [np.ones(3)], 2.0)
    with pytest.raises(LBBSPError, match="shapes"):
        weighted_average([[np.zeros(3)], [np.ones(1)]], [1, 1])


def test_rescale_update_neither_wraps_unsigned_integers_nor_refuses_bools() -> None:
    """5 + 0.5 * (3 - 5) is 4, not 132 (3 - 5 wrapped to 254 in uint8); a bool array raised a TypeError."""
    assert rescale_update([np.array([5], dtype=np.uint8)], [np.array([3], dtype=np.uint8)], 0.5)[0].tolist() == [4]
    out = rescale_update([np.array([False, True])], [np.array([True, True])], 2.0)[0]
    assert out.dtype == bool and out.tolist() == [True, True]


def test_a_client_of_weight_zero_or_many_steps_still_has_a_positive_scale() -> None:
    """tau_eff >= min(steps) >= 1, so no legitimate round gives rescale_update's check a scale of 0 or inf."""
    scales = fednova_scales([1, 2**52], [0, 5])
    assert (scales > 0).all() and np.isfinite(scales).all()
    merged = fednova([np.zeros(2)], [[np.ones(2)], [np.full(2, 3.0)]], [3, 1], [0, 10])
    np.testing.assert_allclose(merged[0], [3.0, 3.0])


def test_a_client_model_of_another_number_of_arrays_is_refused() -> None:
    """zip would pair the arrays the two share and silently drop the rest of the model."""
    with pytest.raises(LBBSPError, match="model has 2 arrays, client sent 1"):
        rescale_update([np.zeros(2), np.zeros(3)], [np.ones(2)], 2.0)
