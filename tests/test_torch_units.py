"""Single-process checks of the torch adapter's small parts (a process group of one rank where one is needed)."""
from __future__ import annotations

import dataclasses
import threading
from collections import namedtuple
from collections.abc import Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import default_collate  # noqa: E402

from lbbsp import ConfigError, Report  # noqa: E402
from lbbsp.integrations.demo import DemoConfig, load_on, parse_schedule  # noqa: E402
from lbbsp.integrations.torch import _GPUReports, device_label, expandable_segments  # noqa: E402
from lbbsp.integrations.torch_data import PlannedBatch, _emptied  # noqa: E402
from lbbsp.integrations.torch_grad import ComputeClock, check_weighting, scaled_loss  # noqa: E402
from lbbsp.models import EWMAThroughput  # noqa: E402


def test_planned_batch_yields_the_plan_once() -> None:
    plan = PlannedBatch()
    assert list(plan) == []
    plan.indices = [4, 2]
    assert list(plan) == [[4, 2]] and list(plan) == []


def _empty_slice(sample: object, collate: Callable[[list], object] = default_collate) -> tuple[object, list[str]]:
    leaks: list[str] = []
    return _emptied(collate([sample]), collate([sample, sample]), leaks), leaks


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: list[int]


def test_an_empty_slice_keeps_the_structure_and_nothing_of_the_sample_whatever_the_collate_fn() -> None:
    Pair = namedtuple("Pair", "x y")
    empty, leaks = _empty_slice({"a": torch.ones(2), "b": [torch.zeros(()), Pair(torch.ones(3), 7)]})
    assert empty["a"].shape == (0, 2) and empty["b"][0].shape == (0,) and not leaks
    assert isinstance(empty["b"][1], Pair) and empty["b"][1].x.shape == (0, 3) and empty["b"][1].y.shape == (0,)
    # a list of the samples themselves (an identity collate_fn): had been a 1-item list of the other rank's sample
    empty, leaks = _empty_slice((torch.ones(5), torch.ones(1), 16), collate=list)
    assert empty == [] and not leaks
    # torchvision's detection style, tuple(zip(*batch)): per-sample tuples, emptied
    empty, _ = _empty_slice((torch.ones(3, 4, 4), {"boxes": torch.ones(2, 4)}), collate=lambda b: tuple(zip(*b)))
    assert empty == ((), ())
    # a dataclass batch: had been passed on whole, so the empty rank trained on the other rank's sample
    empty, leaks = _empty_slice((torch.ones(2), 5), collate=lambda b: Batch(torch.stack([s[0] for s in b]),
                                                                             [s[1] for s in b]))
    assert isinstance(empty, Batch) and empty.x.shape == (0, 2) and empty.ids == [] and not leaks
    # numpy arrays and a field that is not per sample (a constant) keep their structure; a count cannot be cut
    empty, leaks = _empty_slice({"x": np.ones(4), "n": 1, "grid": 3},
                                collate=lambda b: {"x": np.stack([s["x"] for s in b]), "n": len(b), "grid": 3})
    assert empty["x"].shape == (0, 4) and empty["grid"] == 3 and leaks == ["int"]


def test_scaled_loss_weights_and_survives_an_empty_slice() -> None:
    w = torch.ones(2, requires_grad=True)
    assert scaled_loss((w * 2).mean(), 30, 120, 4).item() == pytest.approx(2.0)
    empty = torch.empty(0, 2) @ w
    loss = scaled_loss(empty.mean(), 0, 120, 4)  # the mean of nothing is NaN; its share must be zero
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(w.grad, torch.zeros(2))


def test_weighting_and_clock_validation() -> None:
    assert check_weighting("loss") == "loss"
    with pytest.raises(ConfigError):
        check_weighting("mean")
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    with pytest.raises(ConfigError):
        clock.seconds()
    clock.stop()
    assert clock.ready and clock.seconds() >= 0


def test_demo_flags_are_validated() -> None:
    assert parse_schedule("0-0.5, 0.75-1") == ((0.0, 0.5), (0.75, 1.0))
    assert load_on(((0.0, 0.5),), 10, 40) and not load_on(((0.0, 0.5),), 20, 40)
    for bad in ("0.5-0.2", "x", "0-2"):
        with pytest.raises(ConfigError):
            parse_schedule(bad)
    with pytest.raises(ConfigError):
        DemoConfig(workers=1)
    with pytest.raises(ConfigError):
        DemoConfig(slow_worker=2)


def test_device_label_names_the_gpu_model_so_cold_start_learns_from_the_same_model(monkeypatch) -> None:
    assert device_label(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")  # no GPU here
    a100 = device_label(torch.device("cuda", 3))
    assert a100 == "cuda:NVIDIA A100-SXM4-80GB"
    model = EWMAThroughput().partial_fit([Report("g", 0, 0, 100, 0.1, device=a100),
                                          Report("g", 1, 0, 100, 1.0, device="cuda:Tesla V100-SXM2-16GB"),
                                          Report("g", 2, 0, 0, 0.0, device=a100)])  # joins: nothing measured yet
    assert model.predict([2])[0] == pytest.approx(1000.0)  # the A100's speed, not the V100's or a median


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, False), ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False)])
def test_expandable_segments_is_read_from_either_name_of_the_allocator_setting(
        monkeypatch: pytest.MonkeyPatch, settings: dict[str, str], expected: bool) -> None:
    """Without them a GPU grown toward its memory cap ran out of memory below it (fragmentation): attach warns."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert expandable_segments() is expected


class GatedGPUClock:
    """Stands in for a stopped GPU step's clock: its events are done only once ``done`` is set, and reading them
    waits for that (tests/test_torch_timing.py puts one in a Balancer too)."""

    cuda = True

    def __init__(self, seconds: float = 0.25) -> None:
        self.done = threading.Event()
        self._seconds = seconds

    def start(self) -> None: ...
    def stop(self, *, at_pause: bool = False) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...

    @property
    def ready(self) -> bool:
        return self.done.is_set()

    def seconds(self) -> float:
        assert self.done.wait(30), "the clock was never released"
        return self._seconds


def test_gpu_reports_go_in_order_once_their_events_are_done_without_holding_the_host() -> None:
    sent: list[float] = []
    reports = _GPUReports(sent.append)
    first, second = GatedGPUClock(0.25), GatedGPUClock(0.5)
    reports.put(lambda seconds: seconds, first)  # returns at once: the host queues the next step meanwhile
    reports.put(lambda seconds: seconds, second)
    assert not reports.idle and sent == []
    second.done.set()  # the later step is done first: its report still waits for the earlier one
    waiter = threading.Thread(target=reports.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and sent == []
    first.done.set()
    waiter.join(10)
    assert sent == [0.25, 0.5] and reports.idle
    reports.close()


def test_a_gpu_report_that_fails_to_send_raises_in_the_training_thread_once() -> None:
    sent: list[float] = []
    reports = _GPUReports(sent.append)
    clock = GatedGPUClock(0.1)
    clock.done.set()

    def refused(seconds: float) -> float:
        raise ConfigError(f"compute_s={seconds} refused")

    reports.put(refused, clock)
    reports.put(lambda seconds: seconds, clock)  # the thread outlives a failed report
    reports._queue.join()
    assert reports.idle and sent == [0.1]
    with pytest.raises(ConfigError, match="refused"):  # kept while idle: the next step's report raises it
        reports.check()
    reports.check()  # once
    reports.close()
    reports.wait()


def test_a_sweep_that_remakes_its_process_group_keeps_one_side_group_not_one_per_run(tmp_path, monkeypatch) -> None:
    """cpu_group() kept the gloo side group of every default group it was asked under: a sweep that made and destroyed
    a process group per run held each run's groups and their sockets for good (taken here on the CPU as under NCCL)."""
    import torch.distributed as dist  # noqa: PLC0415

    from lbbsp.integrations import torch as lbbsp_torch  # noqa: PLC0415

    monkeypatch.setattr(lbbsp_torch, "_collective_device", lambda group=None: torch.device("cuda"))
    monkeypatch.setattr(lbbsp_torch, "_CPU_GROUPS", {})
    for run in range(3):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'rendezvous-{run}'}", rank=0, world_size=1)
        try:
            side = lbbsp_torch.cpu_group()
            assert side is not None and lbbsp_torch.cpu_group() is side  # made once per default group
        finally:
            dist.destroy_process_group()
        assert len(lbbsp_torch._CPU_GROUPS) == 1
