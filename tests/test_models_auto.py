"""AutoCapacityModel: the model chosen per worker kind from the hardware it reports, kinds pinned or changed, overrides
checked where given, each kind's reports routed to its model, and the cold-start prior from similar hardware or
the median of the kinds measured."""
from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest

from lbbsp import ConfigError, Coordinator, EWMAThroughput, JobConfig, LBBSPPolicy, Report, Store
from lbbsp.models import (
    AutoCapacityModel,
    BatchTimeCurve,
    FLClientModel,
    LastValue,
    NARXThroughput,
    hardware_of,
    similar_hardware_prior,
    worker_kind,
)
from lbbsp.models.auto import model_moved
from lbbsp.models.base import WorkerIds, device_family


def test_a_model_nested_in_the_auto_model_is_checked_where_the_policy_is_made() -> None:
    """It had been checked at its kind's first report: then every decision of the running job failed."""
    with pytest.raises(ConfigError, match=r"models\['gpu'\]: alpha must be in \(0, 1\], got 5"):
        LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput(alpha=5)}))


def _cpu(worker: int, iteration: int, samples: int, speed: float, cores: int = 16) -> Report:
    return Report("job", worker, iteration, samples, samples / speed if samples else 0.0,
                  features={"cores": cores, "cpu_util": 0.5}, device="cpu")


def _gpu(worker: int, iteration: int, samples: int, speed: float) -> Report:
    used = 2e9 + samples * 2e7
    return Report("job", worker, iteration, samples, 0.02 + samples / speed,
                  features={"cores": 8, "gpu_mem_used": used, "gpu_mem_free": 16e9 - used}, device="cuda:A100")


def test_a_worker_of_open_kind_is_answered_alike_whichever_workers_are_asked_with_it() -> None:
    """Worker 9 had been predicted as a CPU (100/s) alone and as a GPU (1,875/s) beside GPU worker 3: its kind came
    from the workers asked with it, where the docs say all workers."""
    model = AutoCapacityModel()
    for k in range(5):
        model.partial_fit([_cpu(0, k, 10, 100), _cpu(1, k, 10, 100), _cpu(2, k, 10, 100), _gpu(3, k, 100, 3000)])
    alone = model.predict([9])
    assert model.predict([9, 3])[0] == alone[0] == model.predict([0, 1, 2, 3, 9])[4]
    assert model.routed_kinds([9]) == model.routed_kinds([9, 3])[:1] == ["cpu"]  # three CPUs, one GPU
    assert type(model.time_model([9])) is type(model.time_model([9, 0]))


def test_status_shows_the_kind_a_worker_of_open_kind_is_routed_as(redis_url: str, job: str) -> None:
    """A worker that only announced its hardware is routed with its peers, but its status row had shown no kind."""
    store, config = Store.from_url(redis_url, job), JobConfig(job, 3, 300, lag=1)
    coordinator = Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(horizon=1)))
    for k in range(3):
        for worker in range(3):
            measured = worker != 2  # worker 2 only announces its hardware
            store.post_report(Report(job, worker, k, 100 * measured, 1.0 * measured, features={"cores": 16},
                                     device="cpu"), 3)
        coordinator.decide(k)
    coordinator.stop()
    rows = {int(w): json.loads(s) for w, s in store.worker_statuses().items()}
    assert coordinator.policy.model.kind_ == {0: "cpu", 1: "cpu"}  # worker 2's kind is still open
    assert [rows[w]["kind"] for w in range(3)] == ["cpu"] * 3


def test_a_pin_map_with_numpy_ids_outside_the_job_is_refused(redis_url: str, job: str) -> None:
    """{9: "gpu"} was refused for a job of 4 workers, {np.int64(9): "gpu"} (a map built from np.flatnonzero) kept."""
    config = JobConfig(job, 4, 256)
    for pin in (9, np.int64(9), np.uint8(9)):
        with pytest.raises(ConfigError, match=r"pin worker\(s\) \[9\], outside the job's workers 0..3"):
            Coordinator(Store.from_url(redis_url, job), config, LBBSPPolicy(AutoCapacityModel(kinds={pin: "gpu"})))


@pytest.mark.parametrize(("device", "family"), [
    ("cuda:3", "cuda"), ("CUDA:A100", "cuda"), ("/device:GPU:0", "gpu"),
    ("/job:worker/replica:0/task:0/device:GPU:1", "gpu"), ("CPU", "cpu"), ("cpu:0", "cpu"), (" ", "cpu"),
    ("gpu:NVIDIA H100", "gpu"), ("mps", "mps"),
])
def test_devices_are_read_as_one_family_by_every_kind_test(device: str, family: str) -> None:
    """TensorFlow's "/device:GPU:0" had been read as a CPU worker's (NARX, no memory cap), and a GPU worker falling
    back to "CPU" or "cpu:0" had not been seen to move off the GPU curve, where "cpu" was."""
    assert device_family(device) == family
    report = Report("job", 0, 0, 10, 0.1, features={"cores": 4}, device=device)
    assert worker_kind(report) == ("cpu" if family == "cpu" else "gpu")
    assert model_moved("gpu", report) == (family == "cpu")


def test_auto_models_and_kinds_with_unknown_kinds_are_named_where_given() -> None:
    with pytest.raises(ConfigError, match=r"unknown worker kind: models' key 'GPU', kinds\[3\] = 'CPU'; a worker kind "
                                          r"is one of 'cpu', 'gpu', 'fl' \(lower case\)"):
        AutoCapacityModel(models={"GPU": EWMAThroughput()}, kinds={3: "CPU"}).partial_fit(_cpu(0, 0, 10, 100))


def test_auto_explore_with_arrays_of_another_length_names_the_argument() -> None:
    model = AutoCapacityModel().partial_fit([_gpu(0, 0, 100, 3000), _gpu(1, 0, 100, 3000)])
    with pytest.raises(ConfigError, match=r"explore's sizes must hold one value per worker \(2\), got shape \(1,\)"):
        model.explore([0, 1], np.array([5]), np.array([1, 1]), np.array([100, 100]))
    assert model.explore([0, 1], np.array([100, 100]), np.array([1, 1]), np.array([190, 190])).sum() == 200


def test_the_auto_model_routes_availability_to_its_clients_model() -> None:
    model = AutoCapacityModel()
    assert (model.availability([0, 1]) == 1.0).all()  # before any report
    model.partial_fit([Report("j", 0, 0, 10, 1.0, device="phone", features={"download_s": 1.0, "upload_s": 1.0}),
                       Report("j", 1, 0, 10, 1.0, device="cuda:0",
                              features={"gpu_mem_used": 1e9, "gpu_mem_free": 1e9})])
    model.record_outcomes({0: False, 1: False})  # the GPU worker's is left out: it learns no availability
    available = model.availability([0, 1])
    assert available[0] < 1.0 and np.isnan(available[1])
    with pytest.raises(TypeError, match="mapping"):
        model.record_outcomes([(0, True)])  # type: ignore[arg-type]


def test_a_client_that_never_replied_learns_its_availability_through_the_auto_model() -> None:
    model = AutoCapacityModel()
    model.partial_fit([Report("j", i, 0, 10, 1.0, device="phone", features={"download_s": 1.0, "upload_s": 1.0})
                       for i in range(3)])
    model.record_outcomes({5: False})  # routed as its peers are: a client
    assert model.availability([5])[0] < 1.0


def test_a_claimed_transfer_ages_out_once_reports_carry_none() -> None:
    # a training worker whose first report claimed a day of transfer was routed to the client model, which kept
    # that day for good: the predicted finish never fell below it, so the job kept the equal split
    model = AutoCapacityModel()
    model.partial_fit([Report("j", 0, 0, 100, 1.0, features={"download_s": 86_400.0, "upload_s": 0.0}),
                       Report("j", 1, 0, 100, 1.0)])
    for k in range(1, 30):
        model.partial_fit([Report("j", w, k, 100, 1.0) for w in (0, 1)])
    assert model.time_model([0, 1]).time(np.array([100, 100])).max() < 1.1


def test_nested_parameters_of_a_dict_are_refused_with_what_to_do() -> None:
    model = AutoCapacityModel(models={"cpu": EWMAThroughput()})
    with pytest.raises(ValueError, match="'models' is not an estimator .* pass a whole new models="):
        model.set_params(models__cpu__alpha=0.9)
    assert model.models["cpu"].alpha == EWMAThroughput().alpha


def _reports(workers: range, iteration: int = 0) -> list[Report]:
    """One iteration of CPU workers on two kinds of host, each at its own speed."""
    return [Report("j", w, iteration, 64, 0.05 * (1 + w % 3), features={"cores": 4 + 4 * (w % 2)}) for w in workers]


def _reference_prior(values: dict[int, float], hardware: dict[int, tuple[str, int]], workers: list[int]) -> list[float]:
    """The prior as docs/models.md states it, one worker at a time: the median of the finite values of workers
    with the same hardware, else of the same device family, else of all workers."""
    known = {w: v for w, v in values.items() if np.isfinite(v)}
    out = []
    for worker in workers:
        key = hardware.get(worker)
        same = [v for w, v in known.items() if key is not None and hardware.get(w) == key]
        family = [v for w, v in known.items() if key is not None and (hardware.get(w) or ("",))[0] == key[0]]
        out.append(float(np.median(same or family or list(known.values()))))
    return out


def test_the_similar_hardware_prior_matches_its_definition_on_random_clusters() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        devices, cores = ["cpu", "cuda:a100", "cuda:v100"], [4, 8, 16]
        hardware = {int(w): (devices[int(rng.integers(3))], cores[int(rng.integers(3))])
                    for w in rng.choice(2 * n, size=int(rng.integers(0, 2 * n)), replace=False)}
        values = {int(w): float(rng.choice([np.nan, rng.uniform(1, 1000)], p=[0.2, 0.8])) for w in range(n)}
        if not any(np.isfinite(list(values.values()))):
            continue
        asked = [int(w) for w in rng.integers(0, 2 * n, size=int(rng.integers(0, 10)))]
        np.testing.assert_allclose(similar_hardware_prior(values, hardware, asked),
                                   _reference_prior(values, hardware, asked), rtol=1e-12)


@pytest.mark.parametrize("model", [LastValue(), NARXThroughput(), FLClientModel()])
def test_the_prior_follows_hardware_announced_after_a_prediction(model: LastValue) -> None:
    model.partial_fit(_reports(range(5)))
    assert model.predict([9]) == pytest.approx(64 / 0.1)  # nothing known of worker 9's hardware: everyone's median
    model.partial_fit([Report("j", 9, 1, 0, 0.0, features={"cores": 8})])
    assert model.predict([9]) == pytest.approx((64 / 0.1 + 64 / 0.05) / 2)  # the 8-core workers': 1 and 3
    model.fit([_reports(range(5))])  # forgets worker 9's hardware with the rest
    assert model.predict([9]) == pytest.approx(64 / 0.1)


def _history(iterations: int = 16, workers: int = 4) -> list[list[Report]]:
    """A small mixed history: CPU workers with a load feature, a GPU worker whose time is flat then linear in its
    size, speeds that drift, so that what a model keeps depends on every iteration it learnt."""
    rng = np.random.default_rng(3)
    out = []
    for k in range(iterations):
        reports = []
        for w in range(workers):
            samples = 24 + 8 * ((k + w) % 3)
            speed = (100.0 + 30 * w) * (1.0 + 0.3 * np.sin(k / 3 + w)) * rng.uniform(0.95, 1.05)
            gpu = w == workers - 1
            seconds = (0.02 + max(samples - 16, 0) / 400.0) if gpu else samples / speed
            features = {"gpu_mem_used": 1e9 + 5e6 * samples, "gpu_mem_free": 8e9} if gpu else {
                "cpu_util": 0.5 + 0.1 * np.sin(k + w), "colocated_load": 0.2 * (k % 4)}
            reports.append(Report("j", w, k, samples, seconds, features=features,
                                  device="cuda:0" if gpu else "cpu"))
        out.append(reports)
    return out


def test_an_auto_kind_that_is_not_a_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown worker kind: kinds\[0\] = \['gpu'\]; a worker kind is one of"):
        AutoCapacityModel(kinds={0: ["gpu"]}).partial_fit(_history(1)[0])  # was TypeError: unhashable type: 'list'


def test_a_model_class_given_for_a_kind_is_named_with_the_instance_meant() -> None:
    with pytest.raises(ConfigError, match=r"did you mean EWMAThroughput\(\)\?"):
        AutoCapacityModel(models={"cpu": EWMAThroughput}).fit([Report("j", 0, 0, 8, 0.1)])


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


def _cpu_at_0(w: int, n: int, speed: float) -> Report:
    return Report("job", w, 0, n, n / speed, features={"cores": 16, "cpu_util": 0.5})


def _gpu_at_0(w: int, n: int, speed: float) -> Report:
    used = 2e9 + n * 2e7
    return Report("job", w, 0, n, 0.02 + n / speed, device="cuda:A100",
                  features={"cores": 8, "gpu_mem_used": used, "gpu_mem_free": 16e9 - used})


def test_the_auto_models_explore_keeps_each_kind_within_its_own_bounds() -> None:
    model = AutoCapacityModel().partial_fit([_cpu_at_0(0, 50, 100.0), _gpu_at_0(1, 100, 3000.0),
                                             _gpu_at_0(2, 100, 3000.0)])
    assert model.explore([0, 1, 2], np.array([50, 100, 100]), np.ones(3, int), np.array([1000, 1000, 100])).tolist() \
        == [50, 100, 100]


def test_a_kind_not_measured_yet_gets_the_median_of_the_measured_kinds() -> None:
    gpu_announced = Report("job", 3, 0, 0, 0.0, device="cuda:A100", features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e10})
    model = AutoCapacityModel().partial_fit([_cpu_at_0(0, 64, 10.0), _cpu_at_0(1, 64, 20.0), _cpu_at_0(2, 64, 1000.0),
                                             gpu_announced])
    assert model.predict([3])[0] == pytest.approx(20.0)  # the median, not the mean (343)
    client = Report("job", 4, 0, 0, 0.0, device="phone", features={"download_s": 1.0, "upload_s": 1.0})
    mixed = AutoCapacityModel().partial_fit([_cpu_at_0(0, 64, 10.0), _cpu_at_0(1, 64, 20.0), _cpu_at_0(2, 64, 30.0),
                                             _gpu_at_0(3, 100, 3000.0), client])
    assert mixed.predict([4])[0] == pytest.approx(25.0)  # each kind's median: 20 and ~1875, then theirs


def test_gpu_memory_features_make_a_gpu_worker_whatever_its_device() -> None:
    assert worker_kind(Report("k", 0, 0, 8, 0.1, device="cpu",
                              features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e9})) == "gpu"


GB, MB = 1e9, 1e6


@pytest.mark.parametrize("device", ["cuda:0", "GPU:1", "rocm:0", "hip:0", "mps", "xpu:0", "tpu:3"])
def test_every_accelerator_family_is_a_gpu_worker(device: str) -> None:
    assert worker_kind(Report("j", 0, 0, 10, 1.0, device=device)) == "gpu"


def test_the_cpu_model_forecasts_as_far_ahead_as_the_horizon() -> None:
    """AutoCapacityModel(horizon=h) builds its default CPU model (NARX) with that horizon (JobConfig.lag)."""
    model = AutoCapacityModel(horizon=4).partial_fit([Report("j", 0, 0, 10, 1.0)])
    assert model.models_["cpu"].horizon == 4


def test_a_report_with_samples_but_no_time_does_not_count_as_its_kind_measured() -> None:
    """A GPU's report of samples with compute_s 0 measured nothing: the GPU is still planned at the measured CPU's
    speed (the median of the measured kinds), not left unknown (NaN)."""
    model = AutoCapacityModel()
    model.partial_fit([Report("j", 0, 0, 100, 1.0),
                       Report("j", 1, 0, 50, 0.0, device="cuda:0", features={"gpu_mem_used": GB, "gpu_mem_free": GB})])
    assert model.predict([0, 1]).tolist() == pytest.approx([100.0, 100.0])


def test_a_pinned_worker_id_below_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="kinds' key -1"):
        AutoCapacityModel(kinds={-1: "gpu"}).partial_fit([Report("j", 0, 0, 10, 1.0)])


class _Stalled(EWMAThroughput):
    """EWMA speeds, but workers 0 and 1 are forecast to finish nothing (0 samples/s: a model's "never finishes")."""

    def predict(self, workers: WorkerIds) -> np.ndarray:
        speed = super().predict(workers)
        return np.where(np.asarray(workers) < 2, 0.0, speed)


def test_a_kind_not_measured_yet_is_planned_at_the_median_of_the_speeds_that_are_not_zero() -> None:
    """The first GPU of a CPU job is planned at the measured workers' median speed, leaving out those forecast at 0
    (two stalled of three had made it 0: a GPU that never finishes)."""
    model = AutoCapacityModel(models={"cpu": _Stalled()})
    model.partial_fit([Report("j", w, 0, 100, 1.0) for w in range(3)]
                      + [Report("j", 3, 0, 0, 0.0, device="cuda:0", features={"gpu_mem_used": GB, "gpu_mem_free": GB})])
    assert model.predict([3])[0] == pytest.approx(100.0)
    assert model.time_model([3]).time(np.array([100]))[0] == pytest.approx(1.0)


def _mixed_reports() -> list[Report]:
    return [Report("cols", w, 7, 10 * w, 0.1 * (w + 1), device="cuda:0" if w % 2 else "cpu",
                   features={"gpu_mem_used": 1e9, "gpu_mem_free": 2e9} if w % 2 else {"cores": 4})
            for w in range(6)]


def test_a_mixed_job_routes_each_kind_its_own_reports_after_a_move() -> None:
    model = AutoCapacityModel()
    model.partial_fit(_mixed_reports())
    assert {w: model.kind_[w] for w in range(1, 6)} == {1: "gpu", 2: "cpu", 3: "gpu", 4: "cpu", 5: "gpu"}
    moved = [Report("cols", 2, 9, 20, 0.3, device="cuda:0", features={"gpu_mem_used": 1e9, "gpu_mem_free": 2e9})]
    model.partial_fit(moved)  # a CPU worker that starts to read GPU memory is a GPU worker now
    assert model.kind_[2] == "gpu"
    model.partial_fit(_mixed_reports())  # a GPU worker measuring on device "cpu" with no GPU features moved back
    assert model.kind_[2] == "cpu"


def _tf(task: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:GPU:0"


def test_tensorflow_task_paths_are_one_hardware_for_the_cold_start_prior() -> None:
    """TensorFlow's full device names kept the task in the hardware key, so every task's GPU was hardware of its own:
    a new one was predicted at the median of all workers, CPUs included (505 samples/s where its peers do 1,000), and
    given no memory cap (its peers': 269)."""
    assert hardware_of(Report("j", 0, 0, 1, 1.0, device=_tf(1))) == ("gpu", 0)
    assert hardware_of(Report("j", 0, 0, 1, 1.0, device="cuda:A100")) == ("cuda:a100", 0)  # a model name is kept
    speed, memory = EWMAThroughput(), BatchTimeCurve()
    for k in range(20):
        gpus = [Report("j", w, k, 100 + 10 * ((k + w) % 4), 0.01 + (100 + 10 * ((k + w) % 4)) / 1000, device=_tf(w),
                       features={"gpu_mem_used": 1e9 + 5e7 * (100 + 10 * ((k + w) % 4)),
                                 "gpu_mem_free": 15e9 - 5e7 * (100 + 10 * ((k + w) % 4))}) for w in range(3)]
        cpus = [Report("j", w, k, 100, 10.0, features={"cores": 4}) for w in range(3, 6)]
        speed.partial_fit(gpus + cpus)
        memory.partial_fit(gpus)
    new = Report("j", 6, 20, 0, 0.0, device=_tf(6))
    speed.partial_fit([new])
    memory.partial_fit([new])
    assert speed.predict([6])[0] > 900
    assert memory.max_batch([6])[0] == memory.max_batch([0])[0] < 1000
    assert np.isfinite(speed.predict([0, 3])).all()


def _cluster(iterations: int, workers: range) -> list[list[Report]]:
    """Each worker at a speed of its own, on one of three hosts and two devices."""
    return [[Report(f"j{it}", w, it, 64, 0.01 * (1 + w), features={"cores": 4 * (1 + w % 3)},
                    device=("cpu", "cuda:0")[w % 2]) for w in workers] for it in range(iterations)]


@pytest.mark.parametrize("kind", [EWMAThroughput, LastValue, NARXThroughput, FLClientModel, BatchTimeCurve,
                                  AutoCapacityModel])
def test_a_copied_model_follows_hardware_announced_after_its_numbering_was_made(kind: type) -> None:
    """The numbering of the workers' hardware is made at a predict and kept: a model pickled or deep-copied with it,
    then told of new workers (one of hardware never seen), predicts them as a model fitted afresh on the same
    reports does, and a structural set_params forgets it with the rest."""
    history = _cluster(3, range(8))
    announced = [Report("j3", w, 3, 0, 0.0, features={"cores": 4 * (1 + w % 3)}, device=("cpu", "cuda:0")[w % 2])
                 for w in (20, 21)]
    unseen = [Report("j3", 22, 3, 0, 0.0, features={"cores": 96}, device="cuda:1")]
    expected = kind().fit([*history, announced, unseen]).predict([20, 21, 22, 30])
    model = kind().fit(history)
    model.predict([20, 30])  # numbered now, before workers 20 to 22 are known
    for copy_ in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), model):
        copy_.partial_fit(announced)
        copy_.predict([20])
        copy_.partial_fit(unseen)
        np.testing.assert_allclose(copy_.predict([20, 21, 22, 30]), expected, rtol=1e-12)
    if kind is BatchTimeCurve:
        model.set_params(window=4)
        assert not hasattr(model, "hardware_codes_") and not hasattr(model, "hardware_")


def test_routed_kinds_checks_its_workers_before_any_report_too() -> None:
    """Before any report it answered [] to anything, "abc" and 0.5 included, where afterwards they are refused."""
    model = AutoCapacityModel()
    assert model.routed_kinds([0, 1]) == []
    for bad in ("abc", [0.5], [-1]):
        with pytest.raises(ConfigError, match="worker ids must"):
            model.routed_kinds(bad)  # type: ignore[arg-type]
