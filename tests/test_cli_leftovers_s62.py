"""Three small defects of the `lbbsp` command: status rows without a prediction, `--kind -1=gpu`'s argparse error,
and a late SIGTERM that killed a coordinator on its way out."""
from __future__ import annotations

import pytest

from lbbsp.cli import main


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
