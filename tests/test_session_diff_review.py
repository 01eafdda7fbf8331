"""Review of the changes since 6bfcfd4 (allocation, policies, fedagg, telemetry, child logging, checked_process_policy):
what still holds (built-in time models through the new capacity check, memory caps, FedNova's scales, the CPU share,
the leader/straggler search in a normal run) and what had broken, each seen failing before its fix (a parent's log
formatter that the coordinator's child cannot unpickle stopped it from starting; a policy holding a ctypes handle was
no ConfigError)."""
from __future__ import annotations

import ctypes
import itertools
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from lbbsp import JobConfig
from lbbsp.allocation import HingeTime, LinearTime, allocate
from lbbsp.coordinator import CoordinatorProcess, checked_process_policy
from lbbsp.errors import AllocationError, ConfigError
from lbbsp.fedagg import fednova, fednova_scales
from lbbsp.hedging import hedged
from lbbsp.models.auto import MixedTime
from lbbsp.policies import LBBSPPolicy, LeaderStragglerPolicy
from lbbsp.sim.engine import run_policy
from lbbsp.sim.scenarios import GPUMix
from lbbsp.telemetry import ResourceMonitor

# -- ParentLogging: the formatter object travels to the spawned child ------------------------------------------------


class _FormatterHoldingALock(logging.Formatter):
    """A formatter that cannot be pickled, as pytest's own coloured one (it holds the terminal's file)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(message)s")
        self.lock = threading.Lock()


@pytest.fixture
def unpicklable_lbbsp_formatter() -> Iterator[None]:
    handler = logging.StreamHandler()
    handler.setFormatter(_FormatterHoldingALock())
    logger = logging.getLogger("lbbsp")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@pytest.mark.timeout(60)
def test_a_coordinator_process_starts_whatever_formatter_the_parent_logs_with(
        redis_url: str, job: str, unpicklable_lbbsp_formatter: None) -> None:
    process = CoordinatorProcess(redis_url, JobConfig(job, 2, 8), start_timeout_s=20)
    process.stop()


@pytest.mark.timeout(60)
def test_a_script_whose_formatter_class_is_its_own_starts_the_coordinator_process(redis_url: str, job: str,
                                                                                   tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import logging
        from lbbsp import JobConfig
        from lbbsp.coordinator import CoordinatorProcess

        class MyFormatter(logging.Formatter):
            pass

        if __name__ == "__main__":
            handler = logging.StreamHandler()
            handler.setFormatter(MyFormatter("MINE %(message)s"))
            logging.basicConfig(level=logging.INFO, handlers=[handler])
            CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 8), start_timeout_s=20).stop()
            print("STARTED")
    """))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=50)
    assert "STARTED" in done.stdout, done.stderr[-2000:]


# -- checked_process_policy ------------------------------------------------------------------------------------------


def test_a_policy_holding_a_torch_model_passes_the_check_on_every_rank() -> None:
    torch = pytest.importorskip("torch")
    policy = LBBSPPolicy()
    policy.net = torch.nn.Linear(64, 64)  # type: ignore[attr-defined]
    checked_process_policy(policy, JobConfig("review", 4, 64))


def test_a_policy_holding_an_nvml_like_handle_is_a_config_error_naming_it() -> None:
    policy = LBBSPPolicy()
    policy.handle = ctypes.pointer(ctypes.c_int(0))  # type: ignore[attr-defined]  # what pynvml hands back
    with pytest.raises(ConfigError, match="policy LBBSPPolicy cannot be pickled"):
        checked_process_policy(policy, JobConfig("review", 4, 64))


# -- allocate's capacity check against the built-in time models --------------------------------------------------------


def _edge_models() -> Iterator[tuple[str, object, int]]:
    """Built-in time models at edge inputs, with the number of workers each is of."""
    speeds = [0.0, 1e-300, 1.0, 1e300, np.inf]
    overheads = [0.0, 1.0, 1e300, np.inf]
    for n, idle in itertools.product((1, 2, 3), (False, True)):
        for pair, overhead in itertools.product(itertools.product(speeds, repeat=min(n, 2)), overheads):
            speed = np.array([*pair, *([1.0] * (n - len(pair)))])
            model = LinearTime(speed, overhead, idle_is_free=idle)
            yield f"linear {speed} {overhead} {idle}", model, n
            yield f"hedged {speed} {overhead} {idle}", hedged(model, np.linspace(0.5, 2.0, n)), n
    for base, knee, slope, seen in itertools.product([0.0, 1e-9, 1.0], [0.0, 5.0, 1e9], [0.0, 1.0, 1e300, np.inf],
                                                     [0.0, 8.0, 1e9]):
        hinge = HingeTime(*(np.array([value]) for value in (base, knee, slope, seen)))
        yield f"hinge {base} {knee} {slope} {seen}", hinge, 1
        cpus = LinearTime(np.array([2.0, 0.0]), 1.0)
        yield f"mixed {base} {knee} {slope} {seen}", MixedTime(((np.array([0]), hinge), (np.array([1, 2]), cpus)), 3), 3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # speeds of 1e-300 and inf overflow on purpose
def test_no_built_in_time_model_is_refused_by_the_capacity_check() -> None:
    """NaN from a built-in model (0 x inf) had read as none; now NaN is refused: none may answer it, at any edge."""
    for (what, model, n), (batch, lo, hi) in itertools.product(_edge_models(), ((10, 0, 10), (7, 1, 5), (64, 0, 64))):
        if not n * lo <= batch <= n * hi:
            continue
        try:
            sizes = allocate(model, batch, [lo] * n, [hi] * n)  # type: ignore[arg-type]
        except AllocationError:  # workers that never finish: refused before, too
            continue
        assert int(sizes.sum()) == batch and (sizes >= lo).all() and (sizes <= hi).all(), what


# -- memory caps -------------------------------------------------------------------------------------------------------


class _Caps(LBBSPPolicy):
    """LB-BSP whose model answers ``max_batch`` with ``answer`` as given (a list, a 0-d array, ...)."""

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.model.max_batch = lambda workers: answer  # type: ignore[method-assign,return-value,assignment]


@pytest.mark.parametrize(("answer", "caps"), [
    ([5, 7, 9], [5, 7, 9]), ((5, 7, 9), [5, 7, 9]), ([np.int64(5), np.int32(7), np.uint8(9)], [5, 7, 9]),
    ([5, None, 9], [5, 20, 9]), (np.array(6), [6, 6, 6]), (np.int64(6), [6, 6, 6]),
    (np.array([5.5, 7.9, np.nan], dtype=np.float32), [5, 7, 30]), (None, [10, 20, 30]),
])
def test_a_legitimate_max_batch_answer_still_caps(answer: object, caps: list[int]) -> None:
    config = JobConfig("review", 3, 15, max_batch=(10, 20, 30), min_batch=0)
    _, upper = _Caps(answer).bounds(np.arange(3), np.array([5, 5, 5]), config)
    assert upper.tolist() == caps


# -- FedNova's scales ----------------------------------------------------------------------------------------------------


def test_a_client_of_weight_zero_or_many_steps_still_has_a_positive_scale() -> None:
    """tau_eff >= min(steps) >= 1, so no legitimate round gives rescale_update's check a scale of 0 or inf."""
    scales = fednova_scales([1, 2**52], [0, 5])
    assert (scales > 0).all() and np.isfinite(scales).all()
    merged = fednova([np.zeros(2)], [[np.ones(2)], [np.full(2, 3.0)]], [3, 1], [0, 10])
    np.testing.assert_allclose(merged[0], [3.0, 3.0])


# -- telemetry: the machine's busy share against psutil's -----------------------------------------------------------------


_TIMES = type(psutil.cpu_times())  # psutil's scputimes of this platform


def test_the_machine_busy_share_is_psutils_cpu_percent_on_the_same_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's own baseline counts as psutil.cpu_percent does (idle and iowait idle, guest in user already)."""
    start = _TIMES(**dict.fromkeys(_TIMES._fields, 100.0))
    after = _TIMES(*(100.0 + step for step, _ in zip(itertools.cycle([3.0, 0.5, 1.0, 4.0, 2.0]), _TIMES._fields)))
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: start)
    monitor = ResourceMonitor()
    psutil.cpu_percent(None)  # psutil's baseline for this thread: the same times
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: after)
    assert monitor._machine_busy_share() == pytest.approx(psutil.cpu_percent(None) / 100.0, abs=5e-4)


# -- leader/straggler and per-epoch: no reset in a normal run ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_normal_run_through_a_real_coordinator_never_resets_the_leader_straggler_search(redis_url: str) -> None:
    """Reports come in iteration order, in process and through Redis: the reset for iterations that went back (a new
    run under the job's name) never fires, while the search moves the split."""
    resets: list[int] = []
    moves: list[int] = []

    class Watched(LeaderStragglerPolicy):
        def _window_from(self, iteration: int) -> None:
            (resets if iteration == 0 else moves).append(iteration)  # only the reset starts the window at 0
            super()._window_from(iteration)

    for url in (None, redis_url):
        scenario = GPUMix(4, 40, 0)
        run_policy(scenario, "leader-straggler", Watched(model=scenario.capacity_model()), 40, url)
    assert resets == [] and len(moves) >= 2
