"""A report with an unknown feature is refused naming the features a report may carry, the closest first: a
misspelt 'downlod_s' had been refused without a word of what was meant."""
from __future__ import annotations

import pytest

from lbbsp import Report
from lbbsp.errors import ProtocolError
from lbbsp.protocol import FEATURE_RANGES


def test_a_misspelt_feature_is_refused_with_the_name_meant_and_the_known_ones() -> None:
    meant = r"features\.downlod_s: unknown feature; did you mean 'download_s'\?"
    with pytest.raises(ProtocolError, match=meant) as caught:
        Report("fl", 0, 0, 10, 1.0, features={"downlod_s": 3.0})
    assert all(name in str(caught.value) for name in FEATURE_RANGES)


def test_a_feature_like_none_known_is_refused_with_the_known_ones_only() -> None:
    with pytest.raises(ProtocolError, match=r"features\.temperature: unknown feature \(known: cpu_util, ") as caught:
        Report("w", 0, 0, 10, 1.0, features={"temperature": 60.0})
    assert "did you mean" not in str(caught.value)
