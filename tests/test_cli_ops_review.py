"""An operator's review of the `lbbsp` command: clearing a finished job's keys (`lbbsp forget`), the same help and
errors in every subcommand, and a command that answers without importing scikit-learn. Each test failed before its
fix, except the last, which guards the lazy exports of the package."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lbbsp import JobConfig, Store
from lbbsp.cli import main
from lbbsp.store import redacted

LBBSP = [sys.executable, "-m", "lbbsp.cli"]
SERVING = "host.example:4242:abcd"  # the identity a live coordinator claims the job with (host:pid:tag)


def _finished(url: str, job: str, workers: int = 2) -> None:
    """What a finished run of ``job`` leaves in Redis: its settings and a decision, with no coordinator's claim."""
    with Store.from_url(url, job) as store:
        store.register(JobConfig(job, workers, 30))
        store.record_decision('{"iteration": 0, "sizes": [15, 15], "policy": "lbbsp", "written_by_coordinator": true, '
                              '"reason": "kept", "rejected": []}')


def _keys(url: str, job: str) -> list[bytes]:
    with Store.from_url(url, job) as store:
        return list(set(store.client.scan_iter(match=f"lbbsp:{job}:*")))  # SCAN may give a key twice (a resize)


def test_forget_deletes_a_finished_jobs_keys_so_a_rerun_with_other_settings_starts(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun of a finished job with other settings failed until its keys expired (ttl_s, an hour by default), and
    the way out was to delete them by hand with redis-cli; the error said nothing of why nor how."""
    _finished(redis_url, job)
    rerun = ["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]
    assert main(rerun) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    # the command to run names the Redis typed after --redis: `lbbsp forget --job J` alone had no Redis to read
    assert err == (f"lbbsp: error: job {job!r} was started with --workers 2 (not 3); its keys are left by an earlier "
                   f"run, whose coordinator has stopped: `lbbsp forget --job {job} --redis {redacted(redis_url)}` "
                   "clears them once that run is over, or use another job name\n"), err
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)  # found as `lbbsp status` and `lbbsp coordinator` find it
    assert main(rerun[:1] + rerun[3:]) == 2  # the variable's URL: read again by forget, so not repeated
    assert f"`lbbsp forget --job {job}` clears them" in capsys.readouterr().err
    assert main(["forget", "--job", job]) == 0
    assert capsys.readouterr().out == f"forgot job {job!r}: deleted its 2 keys from this Redis\n"
    assert _keys(redis_url, job) == []
    assert main(["forget", "--job", job]) == 0  # nothing left: said so, and no error (the state asked for is there)
    out = capsys.readouterr().out
    assert out.startswith(f"no job {job!r} on this Redis (it never started, or its keys expired)"), out


def test_forget_refuses_a_job_a_coordinator_serves_and_the_mismatch_error_says_so(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Deleting the keys under a live coordinator would take its settings and decisions from it and its workers:
    refused, naming the coordinator; and while one serves the job, the mismatch error does not offer to forget it."""
    _finished(redis_url, job)
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(SERVING, 5)
        keys = sorted(_keys(redis_url, job))
        assert main(["forget", "--redis", redis_url, "--job", job]) == 2
        err = capsys.readouterr().err
        assert err == (f"lbbsp: error: job {job!r} is served by the coordinator {SERVING}: stop that coordinator "
                       "first (its workers would lose their settings and splits), then forget the job\n"), err
        assert sorted(_keys(redis_url, job)) == keys
        assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]) == 2
        err = capsys.readouterr().err
        assert "--workers 2 (not 3)" in err and "forget" not in err, err
        store.forget()


def test_forget_without_a_redis_or_with_a_bad_job_name_is_a_one_line_error(
        redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LBBSP_REDIS_URL", raising=False)
    assert main(["forget", "--job", "alpha"]) == 2
    assert "pass --redis URL or set LBBSP_REDIS_URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["forget", "--redis", redis_url])  # no --job: it forgets one job, never every one
    assert "the following arguments are required: --job" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["status", "forget", "coordinator"])
def test_every_subcommand_names_the_flag_of_a_bad_job_name(sub: str, redis_url: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`lbbsp status --job 'a b'` said "job name must match ...", `lbbsp coordinator` "--job must match ..."."""
    extra = ["--workers", "2", "--global-batch", "8"] if sub == "coordinator" else []
    assert main([sub, "--redis", redis_url, "--job", "a b", *extra]) == 2
    assert capsys.readouterr().err == "lbbsp: error: --job must match [A-Za-z0-9_.-]{1,128}, got 'a b'\n"


def test_status_help_shows_the_default_of_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    """`lbbsp status --help` showed no default for --decisions, where every other subcommand's help shows them."""
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "(default: 0)" in " ".join(capsys.readouterr().out.split())


def test_help_status_and_forget_do_not_import_scikit_learn_or_a_framework(redis_url: str, job: str) -> None:
    """`lbbsp --help` took 2-3 s and each `lbbsp status` error 3-5 s: importing lbbsp imported scikit-learn."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from lbbsp.cli import main
        for argv in (["--help"], ["status", "--help"], ["forget", "--help"],
                     ["status", "--redis", {redis_url!r}], ["status", "--redis", {redis_url!r}, "--job", {job!r}],
                     ["forget", "--redis", {redis_url!r}, "--job", {job!r}], ["-v", "status"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(argv)
                except SystemExit:
                    pass
        print(sorted(m for m in ("sklearn", "torch", "tensorflow", "flwr") if m in sys.modules))
        """)
    _finished(redis_url, job)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n", result.stdout
    assert _keys(redis_url, job) == []  # the forget above ran


def test_every_name_the_package_exports_resolves() -> None:
    """The exports that import scikit-learn are resolved on first use (PEP 562): each still imports, as an attribute
    and with `from lbbsp import ...`, and is the object its module defines."""
    code = textwrap.dedent("""
        import sys
        import lbbsp
        assert "sklearn" not in sys.modules, "import lbbsp imported scikit-learn"
        for name in lbbsp.__all__:
            value = getattr(lbbsp, name)
            assert getattr(sys.modules[value.__module__], name) is value, name  # its module's own object
            assert name in dir(lbbsp), name
        namespace = {}
        exec("from lbbsp import *", namespace)
        assert set(lbbsp.__all__) <= set(namespace), set(lbbsp.__all__) - set(namespace)
        from lbbsp import Coordinator, EWMAThroughput, LBBSPPolicy
        from lbbsp.coordinator import Coordinator as C
        assert Coordinator is C and EWMAThroughput.__name__ == "EWMAThroughput" and LBBSPPolicy.name == "lbbsp"
        try:
            lbbsp.NoSuchName
        except AttributeError as exc:
            assert "NoSuchName" in str(exc), exc
        else:
            raise AssertionError("lbbsp.NoSuchName resolved")
        print("ok", len(lbbsp.__all__))
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok "), result.stdout
