"""Three small defects of the `lbbsp` command: status rows without a prediction, `--kind -1=gpu`'s argparse error,
and a late SIGTERM that killed a coordinator on its way out."""
from __future__ import annotations

import json
import subprocess

import pytest

from emulated import worker_clients
from lbbsp import JobConfig, Store
from lbbsp.cli import main
from test_cli import LBBSP, two_iterations


@pytest.mark.parametrize("separated", [True, False])
def test_a_negative_worker_of_kind_gets_the_flags_own_message(separated: bool,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--kind -1=gpu` got argparse's "expected one argument" (it took -1=gpu for an option), where `--kind=-1=gpu`
    said what WORKER=KIND takes."""
    given = ["--kind", "-1=gpu"] if separated else ["--kind=-1=gpu"]
    with pytest.raises(SystemExit):
        main(["coordinator", "--workers", "2", "--global-batch", "8", *given])
    err = capsys.readouterr().err
    assert "argument --kind: expected WORKER=KIND with WORKER a worker id (0 and up)" in err and "'-1=gpu'" in err, err


def test_joining_kinds_values_leaves_the_other_flags_as_they_were(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a value of --kind that starts as a negative number is joined: a flag after --kind is still a flag, and
    another flag's negative number is still that flag's."""
    for flags, error in ((["--kind", "--verbose"], "argument --kind: expected one argument"),
                         (["--max-decisions", "-1"], "argument --max-decisions: must be at least 1, got -1")):
        with pytest.raises(SystemExit):
            main(["coordinator", "--workers", "2", "--global-batch", "8", *flags])
        assert error in capsys.readouterr().err


def _status_rows(url: str, job: str) -> list[dict[str, object]]:
    """The workers' rows of `lbbsp status --json`, from a process of its own."""
    status = subprocess.run([*LBBSP, "status", "--redis", url, "--job", job, "--json"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert status.returncode == 0, status.stderr
    rows: list[dict[str, object]] = json.loads(status.stdout)["workers"]
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "predicted"), [(["--policy", "per-epoch"], True),
                                                  (["--policy", "leader-straggler"], True),
                                                  (["--policy", "static-proportional"], True),
                                                  (["--policy", "bsp"], False)])
def test_status_shows_each_workers_latest_prediction_or_says_the_policy_makes_none(
        redis_url: str, job: str, flags: list[str], predicted: bool) -> None:
    """Under per-epoch (within an epoch) and leader-straggler, whose decisions carry no prediction, every row showed
    "-" for it, as if it were missing, though the coordinator's model predicted each worker's speed."""
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30", "--max-decisions", "2", *flags],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with worker_clients(redis_url, JobConfig(job, 2, 30)) as clients:
        assert two_iterations(clients).sizes == (15, 15)  # within the epoch, observing, profiling, equal
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, out
    rows = _status_rows(redis_url, job)
    speeds = [row["predicted_throughput"] for row in rows]
    if predicted:  # the model's forecasts: worker 0 measured 100 samples/s, worker 1 300
        assert all(isinstance(s, float) for s in speeds) and speeds[0] < speeds[1], rows  # type: ignore[operator]
        assert [row.get("predicts") for row in rows] == [True, True], rows
    else:
        assert speeds == [None, None] and [row.get("predicts") for row in rows] == [False, False], rows
    table = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", job], capture_output=True, text=True,
                           env={"COLUMNS": "160", "PATH": ""}, timeout=30, check=False).stdout
    worker_rows = [line for line in table.splitlines() if " 15 " in line]
    assert len(worker_rows) == 2 and all(("no model" in row) != predicted for row in worker_rows), table
    with Store.from_url(redis_url, job) as store:
        store.forget()
