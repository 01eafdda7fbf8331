"""A new user's walk through docs/simulator.md and docs/models.md: what the walk found that the code or the pages
got wrong. Writing a variant of LBBSPPolicy with a hook that cannot take the policy's arguments failed every decision
with a logged TypeError (a simulated run read as a policy that never moved); the pages gave no hook's signature; an
fl-clients run stopped by its options named them by FLClients's argument names, which the command line has no
way to give; fit_memory_cap's shape error named a noise shape that the caller had not given."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from lbbsp import ConfigError, LBBSPPolicy
from lbbsp.cli import main
from lbbsp.models import EWMAThroughput, fit_memory_cap
from lbbsp.sim import GPUMix, compare

ROOT = Path(__file__).resolve().parent.parent
#: LBBSPPolicy's hooks, which a variant overrides
HOOK_NAMES = ("bounds", "propose", "dropout")


class FourArgumentPropose(LBBSPPolicy):
    """A variant whose ``propose`` leaves out ``forecast``, which the policy passes it."""

    def propose(self, time_model, config, lower, upper):  # type: ignore[no-untyped-def, override]
        return super().propose(time_model, config, lower, upper)


class NoCurrentBounds(LBBSPPolicy):
    def bounds(self, workers, config):  # type: ignore[no-untyped-def, override]
        return super().bounds(workers, np.zeros(0), config)


class NoWorkersDropout(LBBSPPolicy):
    def dropout(self):  # type: ignore[no-untyped-def, override]
        return None


@pytest.mark.parametrize(("kind", "hook"), [(FourArgumentPropose, "propose"), (NoCurrentBounds, "bounds"),
                                             (NoWorkersDropout, "dropout")])
def test_a_hook_that_cannot_take_the_policys_arguments_is_refused_where_the_policy_is_built(
        kind: type[LBBSPPolicy], hook: str) -> None:
    # it had been built, and then failed every decision with a TypeError: 30 of 30 in a simulated run
    with pytest.raises(ConfigError, match=rf"{kind.__name__}\.{hook} must take {hook}\(.*LBBSPPolicy calls it with"):
        kind(EWMAThroughput())


class Capped(LBBSPPolicy):
    """Hooks written as the page shows them, and one taking ``*args``: accepted, and they balance."""

    def bounds(self, workers, current, config):  # type: ignore[no-untyped-def]
        lower, upper = super().bounds(workers, current, config)
        return lower, np.minimum(upper, 200)

    def propose(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().propose(*args, **kwargs)


def test_hooks_with_the_documented_arguments_run_without_a_failed_decision() -> None:
    scenario = GPUMix(4, 12, seed=0)
    run = compare(scenario, 12, {"capped": Capped(scenario.capacity_model())})["capped"]
    assert run.failed_decisions == 0 and max(max(sizes) for sizes in run.sizes) <= 200


def test_models_md_gives_each_hook_as_the_policy_calls_it() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    for hook in HOOK_NAMES:
        shown = re.findall(rf"`{hook}\(([^`)]*)\)`", page)
        assert shown, f"docs/models.md gives no signature of the hook {hook}"
        named = [part.strip().partition("=")[0] for part in shown[0].split(",")]
        parameters = list(inspect.signature(getattr(LBBSPPolicy, hook)).parameters)[1:]  # without self
        assert named == parameters, (hook, named, parameters)


def test_an_fl_clients_run_stopped_by_its_options_names_them_as_flags(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--scenario", "fl-clients", "--workers", "4", "--iterations", "3",
                 "--local-steps", "1000000", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "past the 86,400 s a report may carry" in err, err
    assert "--local-steps=1000000" in err and "--compute-spread=1.0" in err, err
    assert "local_steps" not in err and "compute_spread" not in err, err  # no argument the command line takes
    assert "model_mb=4.0" in err  # an option without a flag keeps its name


def test_fit_memory_cap_names_only_the_arrays_it_was_given() -> None:
    with pytest.raises(ConfigError) as refused:
        fit_memory_cap(np.array([8.0, 16.0]), np.array([1e9, 2e9]), np.array([True, True]), np.array([1e10]))
    assert "noise" not in str(refused.value).partition(", got ")[2], refused.value  # none given: none named
    with pytest.raises(ConfigError, match=r"noise \(3,\)"):
        fit_memory_cap(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), np.ones(2), noise=np.zeros(3))


def test_a_models_class_given_for_its_instance_says_to_call_it() -> None:
    """LBBSPPolicy(EWMAThroughput) was told only that a model must be an instance, with the class's repr."""
    with pytest.raises(ConfigError, match=r"got the class EWMAThroughput: pass EWMAThroughput\(\)$"):
        LBBSPPolicy(EWMAThroughput)  # type: ignore[arg-type]
