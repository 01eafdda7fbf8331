"""The simulator's notices for a new user (s61): a model planning other local steps than the clients run went
unwarned; clients too fast to measure failed as a worker's report; a time past a day named no policy; and a huge
spread printed numpy's bare "divide by zero" before the clear error."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from lbbsp.cli import main
from lbbsp.errors import ConfigError
from lbbsp.models import AutoCapacityModel, FLClientModel
from lbbsp.policies import BSPPolicy, LBBSPPolicy, LeaderStragglerPolicy
from lbbsp.sim import FLClients, compare, standard_policies


def _local_steps_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "local_steps=" in r.getMessage()]


def test_a_model_planning_other_local_steps_than_the_clients_run_is_warned_of_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """LBBSPPolicy() ran 1.275x the oracle on FLClients (5 local steps; its default client model plans 1), unsaid."""
    scenario = FLClients(8, 3, 0)
    policies = {"default": LBBSPPolicy(), "right": LBBSPPolicy(scenario.capacity_model()),
                "client-model": LBBSPPolicy(FLClientModel(local_steps=2)),
                "auto": LBBSPPolicy(AutoCapacityModel(models={"fl": FLClientModel(local_steps=3)})),
                "auto-right": LBBSPPolicy(AutoCapacityModel(models={"fl": FLClientModel(local_steps=5)}))}
    with caplog.at_level(logging.WARNING):
        compare(scenario, 3, policies)
    said = _local_steps_warnings(caplog)
    assert len(said) == 3, said
    for message, (name, planned) in zip(said, [("default", 1), ("client-model", 2), ("auto", 3)]):
        assert f"policy {name!r} plans federated clients with local_steps={planned}" in message
        assert "runs 5 local steps" in message
        assert "LBBSPPolicy(scenario.capacity_model())" in message and "FLClientModel(local_steps=5)" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        compare(scenario, 3, standard_policies(scenario))
    assert not _local_steps_warnings(caplog)


def test_clients_too_fast_to_measure_are_a_config_error_naming_the_options(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A compute time of 7.9e-10 s had failed as a worker's report: 'compute_s: must be 0 (nothing measured) or at
    least 1e-09 s', a ProtocolError."""
    scenario = FLClients(16, 3, 123, compute_spread=5, batch_per_client=1, local_steps=1)
    with pytest.raises(ConfigError, match=r"policy 'bsp' gives worker 15 7.92e-10 s of compute in iteration 0, under "
                                          r"the 1e-09 s .* too fast to measure; .*batch_per_client.*compute_spread=5"):
        compare(scenario, 3, {"bsp": BSPPolicy()})
    assert main(["simulate", "--scenario", "fl-clients", "--workers", "16", "--iterations", "3", "--seed", "123",
                 "--compute-spread", "5", "--batch-per-client", "1", "--local-steps", "1",
                 "--out", str(tmp_path)]) == 2
    assert "too fast to measure" in capsys.readouterr().err


def test_a_time_past_a_day_names_the_policy_whose_split_gave_it() -> None:
    """The equal split fits a day here, leader-straggler's split in iteration 4 does not: the error had named
    neither."""
    scenario = FLClients(16, 8, 0, batch_per_client=580_000, local_steps=1, compute_spread=0, link_spread=0)
    policies = {"bsp": BSPPolicy(), "leader-straggler": LeaderStragglerPolicy(model=scenario.capacity_model())}
    named = r"the split of policy 'leader-straggler' gives worker \d+ .* s in iteration 4, past the 86,400 s a report"
    with pytest.raises(ConfigError, match=named):
        compare(scenario, 8, policies)


@pytest.mark.parametrize("spread", ["compute_spread", "link_spread"])
def test_a_huge_spread_gives_the_clear_error_without_numpy_s_warning(spread: str) -> None:
    """A spread of 1e6 draws 0 and inf: numpy's 'divide by zero encountered in divide' came first."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scenario = FLClients(16, 3, 0, **{spread: 1e6})  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=rf"inf s in iteration 0, past the 86,400 s .*{spread}=1000000.0"):
            compare(scenario, 3, {"bsp": BSPPolicy()})
