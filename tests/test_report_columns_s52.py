"""Reports read into arrays once per decision (lbbsp.models.base.field / feature), shared by the policy, its margins
and each model of a mixed job: the arrays must match the reports, stay unchanged, and follow a subset."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp import Report
from lbbsp.models import AutoCapacityModel, FLClientModel
from lbbsp.models.base import CheckedReports, as_reports, feature, field


def _reports() -> list[Report]:
    return [Report("cols", w, 7, 10 * w, 0.1 * (w + 1), device="cuda:0" if w % 2 else "cpu",
                   features={"gpu_mem_used": 1e9, "gpu_mem_free": 2e9} if w % 2 else {"cores": 4})
            for w in range(6)]


def test_fields_match_the_reports_and_are_shared_read_only() -> None:
    reports = as_reports(_reports())
    assert field(reports, "worker").tolist() == list(range(6))
    assert field(reports, "samples").tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert field(reports, "device") == ["cpu", "cuda:0"] * 3
    assert field(reports, "worker") is field(reports, "worker")  # read once
    memory = feature(reports, "gpu_mem_used")
    assert np.isnan(memory[::2]).all() and (memory[1::2] == 1e9).all()
    assert feature(reports, "cores", 1.0).tolist() == [4.0, 1.0, 4.0, 1.0, 4.0, 1.0]
    with pytest.raises(ValueError):  # shared by every reader: nobody may change it in place
        field(reports, "samples")[0] = 5.0


def test_a_subset_keeps_order_and_the_arrays_read() -> None:
    reports = as_reports(_reports())
    field(reports, "compute_s")
    part = reports.subset(np.array([1, 4, 5]))
    assert type(part) is CheckedReports and [r.worker for r in part] == [1, 4, 5]
    assert field(part, "compute_s").tolist() == pytest.approx([0.2, 0.5, 0.6])
    assert field(part, "iteration").tolist() == [7, 7, 7]


def test_reports_out_of_iteration_order_are_sorted_and_read_afresh() -> None:
    given = [Report("cols", 0, 8, 1, 0.1), Report("cols", 1, 7, 1, 0.1), Report("cols", 0, 7, 1, 0.1)]
    reports = as_reports(given)
    assert field(reports, "iteration").tolist() == [7, 7, 8]
    assert [(r.worker, r.iteration) for r in reports] == [(1, 7), (0, 7), (0, 8)]  # a stable sort


def test_a_mixed_job_routes_each_kind_its_own_reports_after_a_move() -> None:
    model = AutoCapacityModel()
    model.partial_fit(_reports())
    assert {w: model.kind_[w] for w in range(1, 6)} == {1: "gpu", 2: "cpu", 3: "gpu", 4: "cpu", 5: "gpu"}
    moved = [Report("cols", 2, 9, 20, 0.3, device="cuda:0", features={"gpu_mem_used": 1e9, "gpu_mem_free": 2e9})]
    model.partial_fit(moved)  # a CPU worker that starts to read GPU memory is a GPU worker now
    assert model.kind_[2] == "gpu"
    model.partial_fit(_reports())  # a GPU worker measuring on device "cpu" with no GPU features moved back
    assert model.kind_[2] == "cpu"


def test_federated_transfer_seconds_per_report() -> None:
    reports = [Report("cols", 0, 0, 10, 1.0, device="phone", features={"download_s": 2.0}),
               Report("cols", 1, 0, 10, 1.0, device="phone", features={"bandwidth_down": 1e6, "bandwidth_up": 5e5}),
               Report("cols", 2, 0, 10, 1.0, device="phone"),
               Report("cols", 3, 0, 0, 0.0, device="phone", features={"bandwidth_up": 1e3})]
    model = FLClientModel(model_bytes=1e6).partial_fit(reports)
    np.testing.assert_allclose(model.download_s_, [2.0, 1.0, 0.0])  # each direction learned where it is told
    np.testing.assert_allclose(model.upload_s_, [np.nan, 2.0, 0.0, 1000.0])
    # a direction a client never told is its peers' median there, not free: 2 + 2 s and 1 + 1,000 s
    np.testing.assert_allclose(model.transfer_s([0, 3]), [4.0, 1001.0])
    bare = FLClientModel().partial_fit(reports[:3])  # no model size: bandwidth alone tells no seconds
    np.testing.assert_allclose(bare.download_s_, [2.0, np.nan, 0.0])
