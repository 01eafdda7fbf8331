"""What the mixed job's model keeps between decisions to route the same workers again (each report's kind, each kind's
workers) must follow a worker whose kind is set or changes; NARX's fast paths must give what the general ones give."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp import Report
from lbbsp.models import AutoCapacityModel, NARXThroughput

GPU = {"gpu_mem_used": 1e9, "gpu_mem_free": 2e9}


def _iteration(k: int, moved: dict[int, Report] | None = None) -> list[Report]:
    """Worker 0 on a GPU, workers 1 and 2 on CPUs, ``moved`` in place of a worker's usual report."""
    usual = {0: Report("route", 0, k, 64, 0.1, device="cuda:0", features=GPU),
             1: Report("route", 1, k, 32, 0.2, features={"cores": 8, "cpu_util": 0.5}),
             2: Report("route", 2, k, 32, 0.3, features={"cores": 8, "cpu_util": 0.5})}
    return list((usual | (moved or {})).values())


def test_a_worker_whose_kind_changed_is_routed_by_its_new_kind_at_every_later_iteration() -> None:
    model = AutoCapacityModel()
    for k in range(3):  # the same workers each time: routed from what was kept
        model.partial_fit(_iteration(k))
    cpu_model = model.models_["cpu"]
    assert cpu_model.count_[1] == 3
    model.partial_fit(_iteration(3, {1: Report("route", 1, 3, 32, 0.2, device="cuda:0", features=GPU)}))
    assert model.kind_[1] == "gpu" and cpu_model.count_[1] == 3
    # on its GPU with no GPU features: still a GPU worker, whose reports go to the GPU model, not to the CPU model
    # (routing kept from before the move had sent them there)
    for k in (4, 5):
        model.partial_fit(_iteration(k, {1: Report("route", 1, k, 32, 0.2, device="cuda:0")}))
        assert model.kind_[1] == "gpu" and cpu_model.count_[1] == 3
    groups = model.time_model([0, 1, 2]).groups  # the job's time model groups it there too
    assert [positions.tolist() for positions, _ in groups] == [[2], [0, 1]]


def test_a_worker_first_seen_later_is_routed_and_grouped_once_its_kind_is_set() -> None:
    model = AutoCapacityModel()
    for k in range(2):
        model.partial_fit(_iteration(k)[:2])
    model.partial_fit(_iteration(2))  # worker 2 joins
    model.partial_fit(_iteration(3))
    assert model.kind_[2] == "cpu" and model.models_["cpu"].count_[2] == 2
    groups = model.time_model([0, 1, 2]).groups
    assert [positions.tolist() for positions, _ in groups] == [[1, 2], [0]]


def test_the_workers_handed_to_each_kinds_model_are_shared_read_only() -> None:
    model = AutoCapacityModel()
    model.partial_fit(_iteration(0))
    seen: list[np.ndarray] = []
    cpu_model = model.models_["cpu"]
    predict = cpu_model.predict
    cpu_model.predict = lambda workers: seen.append(workers) or predict(workers)  # type: ignore[method-assign]
    first = model.predict([0, 1, 2])
    assert np.array_equal(model.predict([0, 1, 2]), first)
    assert seen[0].tolist() == [1, 2] and not seen[0].flags.writeable


def test_narx_predicts_the_same_for_workers_it_knows_and_workers_it_does_not() -> None:
    reports = [Report("narx", w, k, 64, 64 / (100.0 * (w + 1)), features={"cores": 4, "proc_cpu": 2.0})
               for k in range(6) for w in range(3)]
    model = NARXThroughput(lags=2).fit(reports)
    known = model.predict([2, 0, 1])
    assert known.tolist() == model.predict(np.array([2, 0, 1], dtype=np.uint8)).tolist()
    assert known == pytest.approx([300.0, 100.0, 200.0], rel=0.1)
    # with a worker never seen, the others' forecasts are the same and the new one gets the prior
    mixed = model.predict([2, 0, 7, 1])
    assert mixed[[0, 1, 3]].tolist() == known.tolist() and mixed[2] == np.median(known)
    mixed[0] = -1.0  # a copy: the next predict is unchanged
    assert model.predict([2, 0, 1]).tolist() == known.tolist()
