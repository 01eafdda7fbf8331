"""Adversarial review of the allocation core: the allocator's invariants over many random cases (numpy generators with
fixed seeds: extreme speed ratios, flat and stepped curves, tight bounds, B from 0 to MAX_BATCH), the margins' and the
client history's state over long runs, and the two bugs found (sitting out beside memory walls raised; a worker whose
model moved kept the margins of its first kind)."""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from lbbsp.allocation import HingeTime, LinearTime, allocate, allocate_sitting_out, damp, predicted_makespan
from lbbsp.client_history import ClientHistory, ClientStatus
from lbbsp.config import JobConfig
from lbbsp.errors import AllocationError, ProtocolError
from lbbsp.hedging import ForecastRisk, hedged
from lbbsp.models.base import CapacityModel, WorkerIds, as_reports
from lbbsp.policies import LBBSPPolicy
from lbbsp.protocol import MAX_BATCH, MAX_REASON_CHARS, Report
from test_allocation import MemoryWall


class Search:
    """``model`` without its ``capacity``: the allocator then searches each worker's size."""

    def __init__(self, model: object) -> None:
        self.model = model

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.model.time(sizes)  # type: ignore[attr-defined]


class Steps:
    """A stepped curve (a GPU that runs whole waves of ``chunk`` samples): flat for many samples, then a jump."""

    def __init__(self, base: np.ndarray, step: np.ndarray, chunk: np.ndarray) -> None:
        self.base, self.step, self.chunk = base, step, chunk

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.base + self.step * np.ceil(np.asarray(sizes, dtype=float) / self.chunk)


def _equal(batch: int, n: int) -> np.ndarray:
    return np.array([batch // n + (i < batch % n) for i in range(n)], dtype=np.int64)


def _random_case(rng: np.random.Generator) -> tuple[object, int, np.ndarray, np.ndarray]:
    """A time model, B and bounds: speeds spread over up to 18 orders of magnitude, overheads, idle workers that
    cost nothing, hinge curves flat past what B needs; B from 0 to MAX_BATCH, and below the number of workers."""
    n = int(rng.integers(1, 60))
    batch = int(rng.choice([rng.integers(0, 3 * n + 1), rng.integers(0, MAX_BATCH + 1), MAX_BATCH]))
    lower, upper = np.zeros(n, dtype=np.int64), np.full(n, batch, dtype=np.int64)
    if rng.random() < 0.5:  # tight bounds
        lower = rng.integers(0, batch // (2 * n) + 2, n)
        upper = lower + rng.integers(0, 3 * batch // n + 2, n)
    low, high = sorted(rng.uniform(-9, 9, 2))
    speed = 10 ** rng.uniform(low, high, n)
    kind = int(rng.integers(4))
    if kind == 0:
        model: object = LinearTime(speed)
    elif kind == 1:
        overhead = np.where(rng.random(n) < 0.5, 0.0, 10 ** rng.uniform(-3, 4, n))
        model = LinearTime(speed, overhead, idle_is_free=bool(rng.random() < 0.5))
    elif kind == 2:
        model = HingeTime(10 ** rng.uniform(-3, 1, n), rng.integers(0, batch // n + 2, n).astype(float),
                          10 ** rng.uniform(-9, 0, n) * (rng.random(n) < 0.9), rng.integers(0, 2 * batch // n + 2, n)
                          .astype(float))
    else:
        model = hedged(LinearTime(speed), rng.uniform(0.5, 3.0, n))
    return model, batch, lower, upper


def test_every_split_sums_to_b_within_bounds_and_is_no_slower_than_the_equal_split() -> None:
    rng = np.random.default_rng(2024)
    checked = 0
    for _ in range(800):
        model, batch, lower, upper = _random_case(rng)
        if not lower.sum() <= batch <= np.minimum(upper, batch).sum():
            with pytest.raises(AllocationError, match="cannot be placed within the bounds"):
                allocate(model, batch, lower, upper)  # type: ignore[arg-type]
            continue
        with np.errstate(all="ignore"):
            sizes = allocate(model, batch, lower, upper)  # type: ignore[arg-type]
            assert sizes.dtype == np.int64 and int(sizes.sum()) == batch
            assert (sizes >= lower).all() and (sizes <= upper).all() and (sizes >= 0).all()
            equal = _equal(batch, lower.size)
            if (equal >= lower).all() and (equal <= upper).all():  # under the model it was given, never slower
                assert predicted_makespan(model, sizes) <= predicted_makespan(model, equal) * (1 + 1e-12)  # type: ignore[arg-type]
        checked += 1
    assert checked > 600
    for huge in (MAX_BATCH + 1, 2**53, 2**53 + 1):  # past a report's largest size: refused, not rounded
        with pytest.raises(AllocationError, match="global_batch must be a whole number"):
            allocate(LinearTime(np.ones(2)), huge, [0, 0], [huge, huge])


def _optimum(model: object, batch: int, lower: np.ndarray, upper: np.ndarray) -> float:
    """The least makespan of any split, by exhaustion over each worker's sizes (curves are non-decreasing)."""
    grids = [np.arange(lo, hi + 1) for lo, hi in zip(lower, upper)]
    per = []
    for i, grid in enumerate(grids):
        sizes = np.tile(lower, (grid.size, 1))
        sizes[:, i] = grid
        per.append(np.array([model.time(row)[i] for row in sizes]))  # type: ignore[attr-defined]

    def holds(deadline: float) -> bool:
        return all(t[0] <= deadline for t in per) and sum(int(g[t <= deadline].max()) for g, t in zip(grids, per)) >= batch

    return float(min(t for t in np.unique(np.concatenate(per)) if holds(t)))


def test_small_splits_reach_the_exhaustive_optimum_on_flat_and_stepped_curves() -> None:
    rng = np.random.default_rng(7)
    for case in range(240):
        n = int(rng.integers(1, 5))
        lower = rng.integers(0, 4, n)
        upper = lower + rng.integers(0, 16, n)
        batch = int(rng.integers(lower.sum(), upper.sum() + 1))
        if case % 3 == 0:
            model: object = HingeTime(rng.uniform(0, 1, n), rng.integers(0, 12, n).astype(float),
                                      10 ** rng.uniform(-3, 1, n) * (rng.random(n) < 0.8),
                                      rng.integers(0, 20, n).astype(float))
        elif case % 3 == 1:
            model = Steps(rng.uniform(0, 1, n), rng.uniform(0, 1, n), rng.integers(1, 6, n))
        else:
            model = hedged(LinearTime(10 ** rng.uniform(-3, 3, n), rng.uniform(0, 1, n), bool(rng.random() < 0.5)),
                           rng.uniform(0.5, 2.0, n))
        best = _optimum(model, batch, lower, upper)
        for asked in (model, Search(model)):
            sizes = allocate(asked, batch, lower, upper)  # type: ignore[arg-type]
            assert sizes.sum() == batch and (sizes >= lower).all() and (sizes <= upper).all()
            assert predicted_makespan(model, sizes) <= best * (1 + 1e-9), (case, sizes.tolist())  # type: ignore[arg-type]


def test_a_permutation_of_the_workers_permutes_the_split_and_ties_go_to_the_lowest_positions() -> None:
    """The search reads sums, minima and maxima; only the last samples' fill breaks ties, by position, so the same
    inputs give the same split in any process, and identical workers' remainders go to the first positions."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 40))
        speed, overhead = 10 ** rng.uniform(-3, 3, n), rng.uniform(0, 1, n)
        batch = int(rng.integers(0, 100 * n))
        order = rng.permutation(n)
        sizes = allocate(LinearTime(speed, overhead), batch, np.zeros(n, dtype=np.int64), np.full(n, batch))
        again = allocate(LinearTime(speed, overhead), batch, np.zeros(n, dtype=np.int64), np.full(n, batch))
        permuted = allocate(LinearTime(speed[order], overhead[order]), batch, np.zeros(n, dtype=np.int64),
                            np.full(n, batch))
        assert (sizes == again).all() and (permuted == sizes[order]).all()
    for n, batch in ((3, 100), (7, 1000), (1024, 1024 * 64 + 5)):
        assert allocate(LinearTime(np.ones(n)), batch, [0] * n, [batch] * n).tolist() == _equal(batch, n).tolist()


@pytest.mark.parametrize("kind", ["linear", "hinge", "hedged"])
def test_a_decision_at_1024_workers_takes_milliseconds(kind: str) -> None:
    """About 0.1-1 ms here; a loop in Python over the workers at each of the search's steps would take 100x that."""
    rng = np.random.default_rng(0)
    n = 1024
    model: object = {"linear": lambda: LinearTime(10 ** rng.uniform(-3, 3, n)),
                     "hinge": lambda: HingeTime(rng.uniform(0.01, 0.1, n), rng.integers(0, 64, n).astype(float),
                                                rng.uniform(1e-4, 1e-3, n), np.full(n, 128.0)),
                     "hedged": lambda: hedged(LinearTime(rng.lognormal(0, 0.5, n)), rng.uniform(1, 1.5, n))}[kind]()
    lower, upper = np.ones(n, dtype=np.int64), np.full(n, 64 * n, dtype=np.int64)
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        allocate(model, 64 * n, lower, upper)  # type: ignore[arg-type]
        seconds.append(time.perf_counter() - start)
    assert np.median(seconds) < 0.05, seconds


def test_the_dead_band_keeps_one_of_the_two_splits_and_moves_only_for_a_gain_past_it() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 20))
        model = LinearTime(10 ** rng.uniform(-2, 2, n))
        batch = int(rng.integers(n, 50 * n))
        current = rng.multinomial(batch, np.full(n, 1 / n))
        proposed = allocate(model, batch, [0] * n, [batch] * n)
        band = float(rng.choice([0.0, 0.03, 0.3]))
        chosen, moved = damp(current, proposed, model, band)
        assert int(chosen.sum()) == batch
        gain = predicted_makespan(model, proposed) * (1 + band) < predicted_makespan(model, current)
        assert moved == gain and (chosen == (proposed if moved else current)).all()


# -- sitting out beside memory walls -----------------------------------------------------------------------------------


def test_sitting_out_beside_workers_walled_short_of_their_bounds_keeps_everyone_in() -> None:
    """With a worker out, the others' walls (30 each) could not hold B = 100 although their bounds (100 each) could:
    allocate_sitting_out raised 'the time model predicts that 3 of 4 workers never finish, and the others cannot hold
    the global batch 100' where allocate alone split B; a speed of 0 on a worker due back did the same."""
    walls = MemoryWall([1.0, 2.0, 3.0, 4.0], [30] * 4)
    everyone = allocate(walls, 100, [0] * 4, [100] * 4)
    assert allocate_sitting_out(walls, 100, [0] * 4, [100] * 4, share=0.25).tolist() == everyone.tolist()
    stalled = LinearTime(np.array([0.0, 1.0, 1.0, 1.0]), overhead=np.array([0.0, 1.0, 1.0, 50.0]), idle_is_free=True)
    sizes = allocate_sitting_out(stalled, 100, [0] * 4, [100, 40, 40, 40], 0.25, stay=[True, False, False, False])
    assert sizes.tolist() == allocate(stalled, 100, [1, 0, 0, 0], [100, 40, 40, 40]).tolist()


class WalledModel(CapacityModel):
    """A capacity model of one's own whose time model has memory walls (no ``max_batch``: the time says it)."""

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> WalledModel:
        as_reports(reports)
        self.seen_ = True
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("seen_")
        return np.array([1.0, 2.0, 3.0, 4.0])[np.asarray(workers)]

    def time_model(self, workers: WorkerIds) -> MemoryWall:  # type: ignore[override]
        return MemoryWall(self.predict(workers), [30] * len(workers))


def test_a_policy_that_lets_workers_sit_out_beside_memory_walls_still_decides() -> None:
    """Each decision raised the AllocationError above (the coordinator kept the split in force, every iteration)."""
    config = JobConfig("walls", 4, 100, min_batch=0)
    policy = LBBSPPolicy(WalledModel(), hedge=None, sit_out=0.25, deadband=0.0)
    policy.observe([Report("walls", w, 0, 25, 0.25) for w in range(4)])
    decision = policy.decide(1, config.initial_sizes(), config)
    assert sum(decision.sizes) == 100 and max(decision.sizes) <= 30 and min(decision.sizes) > 0


# -- margins ------------------------------------------------------------------------------------------------------------


def _mixed_reports(k: int, rng: np.random.Generator, gpus_on_cpu: bool) -> list[Report]:
    """20 GPUs (precise) on 32-core hosts, 20 shared CPUs (1-1.6x slowdowns) on 8-core ones; ``gpus_on_cpu``: the
    GPUs report as their first step did under gloo without DDP, timed on the CPU before the model's device was known."""
    gpu = {"cores": 32.0, "gpu_mem_used": 2e9, "gpu_mem_free": 7e10}
    out = []
    for w in range(40):
        if w < 20 and not gpus_on_cpu:
            out.append(Report("m", w, k, 64, 0.064 * float(rng.lognormal(0.0, 0.005)), device="cuda:A100",
                              features=gpu))
        else:
            seconds = 0.064 * float(rng.lognormal(0.0, 0.005)) if w < 20 else 0.64 * float(rng.uniform(1.0, 1.6))
            out.append(Report("m", w, k, 64, seconds, features={"cores": 32.0 if w < 20 else 8.0}))
    return out


def test_a_gpu_whose_first_report_came_from_the_cpu_gets_the_gpus_margins_once_it_reads_its_gpu() -> None:
    """Its hardware group, and so its kind, came from its first report for good, while AutoCapacityModel moved it to
    the GPU curve: the GPUs were planned with the CPUs' margins (x1.52-1.54 here, where GPUs apart get under
    x1.03), and a mixed job of 16 + 16 ran 12-14% slower than with the GPUs' first report from cuda."""
    rng = np.random.default_rng(0)
    risk = ForecastRisk()
    workers, forecast = np.arange(40), np.where(np.arange(40) < 20, 1000.0, 100.0)
    for k in range(20):
        risk.record(k, workers, forecast)
        risk.observe(_mixed_reports(k, rng, gpus_on_cpu=k == 0), defer=True)
        risk.finish_learning()
    risk.record(20, workers, forecast)
    factor = risk.factors(20)
    assert factor[:20].max() < 1.03 and factor[20:].min() > 1.4
    # and back: a GPU worker measuring on the CPU with no GPU features joins the CPUs' group
    risk.observe([Report("m", 0, 20, 64, 0.64, features={"cores": 8.0})])
    risk.record(21, workers, forecast)
    assert risk.factors(21)[0] > 1.4 and risk.factors(21)[1:20].max() < 1.03


def test_the_margins_state_stays_bounded_over_a_long_run_and_follows_the_worker_set() -> None:
    rng = np.random.default_rng(1)
    risk = ForecastRisk(pool_size=64, min_samples=8, keep=4)
    shape = risk.pool_.shape
    counts = [12] * 200 + [5] * 100 + [30] * 100  # workers leave, then more join
    for k, n in enumerate(counts):
        workers = np.arange(n)
        risk.record(k, workers, np.full(n, 100.0))
        assert risk.factors(k).shape == (n,)
        risk.observe([Report("b", w, k, 64, 0.64 * float(rng.uniform(1.0, 1.5))) for w in range(n)], defer=True)
        risk.finish_learning()
        assert len(risk.forecasts_) <= 4
    assert risk.pool_.shape == shape and risk.pooled_.sum() == sum(counts)
    assert risk.peer_group_.size == 30 and len(risk.groups_) == 1
    assert 1.3 < risk.factors(len(counts) - 1).min() <= risk.factors(len(counts) - 1).max() < 1.5


# -- client history -----------------------------------------------------------------------------------------------------


def test_the_client_history_stays_bounded_over_a_long_run(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job, max_reports=5, ttl_s=3600) as history:
        assert history.worker_indices(["a", "a", 7, "7", "b"]) == [0, 0, 1, 1, 2]  # one index per key, in one call
        for k in range(120):
            history.record([Report(job, w, k, 10, 0.1) for w in range(3)],
                           {w: ClientStatus(k, "ok") for w in range(3)})
        keys = history.client.keys(f"lbbsp:{job}:fl:*")
        assert [history.client.llen(history.key("reports", w)) for w in range(3)] == [5, 5, 5]
        assert all(0 < history.client.ttl(key) <= 3600 for key in keys)
        assert [r[0].iteration for r in history.rounds()] == list(range(115, 120))
        assert {w: s.round for w, s in history.statuses().items()} == {0: 119, 1: 119, 2: 119}


@pytest.mark.parametrize(("args", "field"), [((-1, "ok"), "round"), ((1, "done"), "status"), ((1, "ok", None), "reason"),
                                             ((1, "ok", "", float("nan")), "at"), ((1, "ok", "", -1.0), "at")])
def test_a_client_status_is_checked_where_it_is_made(args: tuple, field: str) -> None:
    """A bad status had been written over the client's good one, then skipped when read: now refused when made, with
    the field named, as when read; a long reason is still cut to its limit when written, and reads back."""
    with pytest.raises(ProtocolError) as caught:
        ClientStatus(*args)
    assert caught.value.field == field
    long = ClientStatus(2, "failed", "x" * 10_000, 5)
    assert long.at == 5.0 and isinstance(long.at, float)
    assert ClientStatus.from_json(long.to_json()) == ClientStatus(2, "failed", "x" * MAX_REASON_CHARS, 5.0)
