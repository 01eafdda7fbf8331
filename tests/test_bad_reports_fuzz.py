"""The coordinator survives any single bad report (real Redis, the default LB-BSP policy and models): whatever
worker 1 posts, as bytes or as a report with one field, feature or device made arbitrary, each step writes a
whole split within the bounds from the others' reports, and a payload it refuses is named as worker 1's."""
from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulated import worker_clients
from lbbsp import Coordinator, JobConfig, Store
from lbbsp.protocol import _REPORT_FIELDS, FEATURE_RANGES

WORKERS, GLOBAL_BATCH, ITERATIONS = 3, 30, 4

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
#: Values at the edges a worker's numbers reach: ranges' ends, tiny, huge, negative, not finite, wrong types.
_edges = st.sampled_from([0, -1, 1, 2**53 + 1, 10**30, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, -0.0,
                          True, "1", [], {}])
_fields = st.sampled_from(sorted(_REPORT_FIELDS | {"extra"}))


def _report(job: str, iteration: int, samples: int) -> dict[str, Any]:
    return {"v": 1, "job": job, "worker": 1, "iteration": iteration, "samples": samples, "compute_s": 0.02,
            "features": {"cpu_util": 0.5, "cores": 4}}


@st.composite
def _payloads(draw: st.DrawFn) -> tuple[str, Any, Any]:
    """How worker 1's report is spoiled: raw bytes, one field, one feature or the device, with any JSON value."""
    how = draw(st.sampled_from(["bytes", "field", "feature", "device"]))
    if how == "bytes":
        return how, None, draw(st.binary(max_size=200))
    value = draw(_edges | _json)
    if how == "field":
        return how, draw(_fields), value
    if how == "feature":
        return how, draw(st.sampled_from([*sorted(FEATURE_RANGES), "bogus"])), value
    return how, "device", draw(st.sampled_from(["cuda:0", "phone", "", "x" * 100]) | st.text(max_size=8) | _edges)


def _spoiled(job: str, iteration: int, samples: int, how: str, name: Any, value: Any) -> bytes:
    if how == "bytes":
        return bytes(value)
    report = _report(job, iteration, samples)
    if how == "feature":
        report["features"][name] = value
    else:
        report[name] = value
    return json.dumps(report).encode()  # NaN and Infinity written as JSON5-like tokens, as a hostile sender might


@pytest.mark.timeout(600)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spoil=_payloads(), at=st.integers(0, ITERATIONS - 1))
def test_any_single_bad_report_leaves_every_step_a_whole_split(redis_url: str, spoil: tuple[str, Any, Any],
                                                              at: int) -> None:
    job = f"fuzz-{uuid.uuid4().hex[:10]}"
    config = JobConfig(job, WORKERS, GLOBAL_BATCH, lag=1)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(ITERATIONS):
            sizes = clients[0].assignment(k).sizes
            if k == at:
                payload = _spoiled(job, k, sizes[1], *spoil)
                stored = store.post_raw_report(k, "1", payload, WORKERS)
                assert stored in (1, -1), stored  # stored, or refused inside Redis as too big
            else:
                clients[1].report(k, sizes[1], 0.02)
                clients[1].flush()
            for i in (0, 2):
                clients[i].report(k, sizes[i], 0.01 * (i + 1))
                clients[i].flush()
            outcome = coordinator.step(timeout_s=5 if k != at or stored == 1 else 0.5)
            assert outcome is not None and outcome.written, (k, spoil)
            split = outcome.assignment.sizes
            assert len(split) == WORKERS and sum(split) == GLOBAL_BATCH and min(split) >= config.min_batch, split
            assert {r.worker for r in outcome.rejected} <= ({"1"} if k == at else set()), (spoil, outcome.rejected)
            assert all(r.error for r in outcome.rejected)
            assert clients[2].assignment(k + 1) == outcome.assignment
        assert coordinator.failed_decisions == 0, spoil
