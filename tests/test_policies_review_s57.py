"""Policies after a fresh-eyes review: static proportional profiles late workers and follows the job's batch,
the leader/straggler search brings back a worker given nothing, per-epoch probes a worker due back for one
iteration, the oracle keeps LB-BSP's rejoin rule, and a split is checked against the job it is decided for."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from lbbsp import ConfigError, JobConfig, Report
from lbbsp.allocation import LinearTime
from lbbsp.models import EWMAThroughput
from lbbsp.policies import (
    LBBSPPolicy,
    LeaderStragglerPolicy,
    OraclePolicy,
    PerEpochPolicy,
    Policy,
    StaticProportionalPolicy,
)


def _run(policy: Policy, speeds: Callable[[int], list[float]], iterations: int, config: JobConfig,
         reports_from: Callable[[int], list[int]] | None = None) -> list[tuple[tuple[int, ...], str]]:
    """Each iteration's split and the reason it was decided for, as a coordinator runs them: the reports of k decide
    k + the job's lag. Only the workers ``reports_from(k)`` report (all by default); a worker given nothing reports
    0 s."""
    lag = config.lag
    planned = {k: tuple(config.initial_sizes()) for k in range(lag)}
    reasons = {k: "initial" for k in range(lag)}
    for k in range(iterations):
        speed, sizes = np.asarray(speeds(k), dtype=float), planned[k]
        reporting = range(config.num_workers) if reports_from is None else reports_from(k)
        policy.observe([Report(config.job, w, k, sizes[w], sizes[w] / speed[w]) for w in reporting])
        decision = policy.decide(k + lag, planned[k + lag - 1], config)
        policy.learn()
        planned[k + lag], reasons[k + lag] = decision.sizes, decision.reason
    return [(planned[k], reasons[k]) for k in range(iterations)]


def test_static_proportional_profiles_a_worker_first_measured_after_the_others() -> None:
    """Worker 3 reports nothing until iteration 6: once it does, the split is fixed again with its speed (it had
    kept the median's share for good, 0.0725 s an iteration where 0.0437 s was the balance)."""
    config = JobConfig("s", 4, 64)
    history = _run(StaticProportionalPolicy(), lambda k: [100, 200, 400, 800], 12, config,
                   reports_from=lambda k: [0, 1, 2, 3] if k >= 6 else [0, 1, 2])
    assert history[4][0] != (4, 8, 17, 35)
    assert history[-1][0] == (4, 8, 17, 35)


def test_static_proportional_follows_a_change_of_the_jobs_batch_and_checks_the_split() -> None:
    policy = StaticProportionalPolicy(profile_iterations=1)
    small, large = JobConfig("s", 4, 64), JobConfig("s", 4, 128)
    _run(policy, lambda k: [100, 200, 400, 800], 2, small)
    assert sum(policy.decide(3, (32,) * 4, large).sizes) == 128  # a split fixed for 64 had been handed on
    assert max(policy.decide(4, (32,) * 4, JobConfig("s", 4, 128, max_batch=40)).sizes) <= 40
    with pytest.raises(ConfigError, match="add up to the global batch"):
        policy.decide(5, (99, 0, 0, 0), small)
    policy.decide(6, (16,) * 4, small)  # fixed again for this job: the next call checks its split all the same
    with pytest.raises(ConfigError, match="add up to the global batch"):
        policy.decide(7, (99, 0, 0, 0), small)


def test_leader_straggler_search_brings_back_a_worker_given_nothing() -> None:
    """With min_batch 0, worker 0 (slow for 40 iterations) is given nothing, then becomes the fastest: it is a
    leader again (it had sent no report to be one, and stayed at 0 for good, 4.6x slower than LB-BSP)."""
    config = JobConfig("l", 4, 16, min_batch=0)
    history = _run(LeaderStragglerPolicy(), lambda k: [10 if k < 40 else 2000, 200, 200, 200], 120, config)
    assert 0 in [sizes[0] for sizes, _ in history[:40]]
    assert history[-1][0][0] >= 8


def test_leader_straggler_search_brings_back_a_slow_worker_only_now_and_then() -> None:
    """Worker 0 stays slow: it is given samples again after rejoin_after windows at 0, not at every other window
    (155 of 300 iterations, 1.9x slower than leaving it out)."""
    config = JobConfig("l", 4, 16, min_batch=0)
    history = _run(LeaderStragglerPolicy(), lambda k: [10, 200, 200, 200], 300, config)
    assert 10 < sum(sizes[0] > 0 for sizes, _ in history) < 60


@pytest.mark.parametrize("lag", [1, 2])
def test_per_epoch_gives_a_worker_due_back_samples_until_it_is_measured(lag: int) -> None:
    """A slow worker due back runs for ``lag`` iterations (the split that brought it back had been kept a whole
    epoch), and a worker found fast by its probe is kept, not set back to 0 for the rest of the epoch (decided
    again the next iteration, at lag 2 its probe was not measured yet)."""
    config = JobConfig("e", 3, 16, min_batch=0, lag=lag)
    history = _run(PerEpochPolicy(iterations_per_epoch=5), lambda k: [100, 1, 1], 130, config)
    probes = [k for k, (sizes, _) in enumerate(history) if k >= 5 and (sizes[1] or sizes[2])]  # after the first epoch
    runs = np.split(np.array(probes), np.flatnonzero(np.diff(probes) > 1) + 1)
    assert len(runs) >= 2 and all(run.size == lag for run in runs), probes
    assert any("due back after 10 epoch(s)" in reason for _, reason in history)
    became_fast = _run(PerEpochPolicy(iterations_per_epoch=5), lambda k: [100, 1 if k < 40 else 400, 1], 80, config)
    first = next(k for k, (sizes, _) in enumerate(became_fast) if k >= 40 and sizes[1])
    assert all(sizes[1] > 0 for sizes, _ in became_fast[first:first + 5]), became_fast[first:first + 5]


def test_lbbsp_says_which_workers_are_due_back() -> None:
    config = JobConfig("b", 5, 3, min_batch=0)
    history = _run(LBBSPPolicy(), lambda k: [100, 200, 400, 800, 50], 40, config)
    assert any("due back after 10 iteration(s) given nothing" in reason for _, reason in history)
    assert not any("does not fit the bounds" in reason for _, reason in history)


def test_the_oracle_brings_back_a_worker_given_nothing_as_lbbsp_does() -> None:
    """min_batch 0 without sit_out: the oracle had ignored rejoin_after, so LB-BSP was held to a rule the limit
    was not."""
    config = JobConfig("o", 4, 16, min_batch=0)
    oracle, sizes, first = OraclePolicy(rejoin_after=2), tuple(config.initial_sizes()), []
    for k in range(2, 10):
        oracle.reveal(LinearTime(np.array([0.1, 200.0, 200.0, 200.0])))
        sizes = oracle.decide(k, sizes, config).sizes
        first.append(sizes[0])
    assert first == [0, 0, 1, 0, 0, 1, 0, 0]


def test_lbbsp_checks_its_own_last_split_against_the_job_it_is_given() -> None:
    policy = LBBSPPolicy(EWMAThroughput(), hedge=None)
    policy.observe([Report("c", i, 0, 16, 16 / s) for i, s in enumerate([100, 200, 400, 800])])
    decided = policy.decide(2, (16,) * 4, JobConfig("c", 4, 64)).sizes
    with pytest.raises(ConfigError, match="add up to the global batch"):
        policy.decide(3, decided, JobConfig("c", 4, 128))
