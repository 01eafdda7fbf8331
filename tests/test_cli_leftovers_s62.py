"""Three small defects of the `lbbsp` command: status rows without a prediction, `--kind -1=gpu`'s argparse error,
and a late SIGTERM that killed a coordinator on its way out."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from emulated import worker_clients
from lbbsp import JobConfig, Store
from lbbsp.cli import main
from test_cli import LBBSP, two_iterations


@pytest.mark.parametrize(("given", "value"), [(["--kind", "-1=gpu"], "-1=gpu"), (["--kind=-1=gpu"], "-1=gpu"),
                                              (["--kind", "\u0661=gpu"], "\u0661=gpu"),
                                              (["--kind", "\u00b2=gpu"], "\u00b2=gpu")])
def test_a_bad_worker_of_kind_gets_the_flags_own_message(given: list[str], value: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--kind -1=gpu` got argparse's "expected one argument" (it took -1=gpu for an option), where `--kind=-1=gpu`
    said what WORKER=KIND takes. A digit that is not ASCII was taken as a worker id (an Arabic-Indic one as worker 1) or
    got "invalid kind_pin value" (a superscript, which int refuses)."""
    with pytest.raises(SystemExit):
        main(["coordinator", "--workers", "2", "--global-batch", "8", *given])
    err = capsys.readouterr().err
    assert "argument --kind: expected WORKER=KIND with WORKER a worker id (0 and up)" in err and repr(value) in err, err


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


#: A coordinator whose final clean-up (closing its embedded server) gets a SIGTERM, 0.3 s after the first: later
#: than the repeat of one stop (_SAME_SIGNAL_S), sent by the process itself so that it comes exactly there.
_LATE_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time
    from lbbsp.cli import main
    from lbbsp.embedded import EmbeddedRedis

    close = EmbeddedRedis.close

    def late_sigterm(self):
        print("closing", self.directory, flush=True)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        close(self)

    EmbeddedRedis.close = late_sigterm
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.timeout(60)
def test_a_sigterm_during_the_final_exit_ends_the_coordinator_as_the_first_did(job: str) -> None:
    """A second SIGTERM after the stop signals' handlers were put back, as the command closed its embedded server,
    killed it: -15, and the server's files left behind (its claim on the job was released by then)."""
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    coordinator = subprocess.Popen([sys.executable, "-c", _LATE_SIGTERM, "coordinator", "--job", job, "--workers",
                                    "2", "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
    try:
        assert coordinator.stdout is not None
        started = coordinator.stdout.readline()
        assert started.startswith("started an embedded redis-server"), started
        serving = coordinator.stdout.readline()
        assert serving.startswith(f"coordinating job '{job}'"), serving
        coordinator.send_signal(signal.SIGTERM)
        out, err = coordinator.communicate(timeout=30)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0, (out, err)  # as a SIGTERM alone ends it
    closing, stopped = out.splitlines()
    assert f"stopped serving job '{job}' after 0 decisions (SIGTERM)" in stopped and "Traceback" not in err, err
    assert not Path(closing.split(maxsplit=1)[1]).exists()  # the embedded server's directory is gone
