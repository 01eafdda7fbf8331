"""What a Flower user's walkthrough of docs/flower.md met on LocalGrid (flwr 1.42, real Redis): lbbsp's own client
errors cut off before their fix, a LoadBalanced wrapped in another, a misnamed ``config_key`` read as "wrap the
strategy in LoadBalanced", the data-size advice given for an ``lbbsp-`` metric, and a legacy NumPyClient's bare
KeyError."""
from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from lbbsp.errors import ConfigError
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_local import LocalGrid
from test_flower_client_review import send_one
from test_flower_history_hardening_review import error_reply_round
from test_flower_port import fedavg


def _message(config_key: str = "config", **others: ConfigRecord) -> Message:
    LocalGrid(ClientApp(), [{}])  # sets Flower's task identity so that messages can be built here
    records = {"arrays": ArrayRecord([np.zeros(1)]), config_key: ConfigRecord(Workload(4, 2).to_config()), **others}
    return Message(RecordDict(records), dst_node_id=1, message_type=MessageType.TRAIN)


def test_a_load_balanced_strategy_is_not_wrapped_again(redis_url: str, job: str) -> None:
    """The outer one had planned "equal split (no measurements yet)" every round and warned that the clients replied
    without lbbsp's metrics."""
    with ClientHistory.from_url(redis_url, job) as history:
        inner = LoadBalanced(fedavg(), history, batch_size=8)
        with pytest.raises(ConfigError, match=r"strategy is a LoadBalanced already: wrap the Flower strategy itself"):
            LoadBalanced(inner, history, batch_size=8)


@pytest.mark.parametrize("default", [None, Workload(2, 1)])
def test_a_config_key_naming_another_record_says_where_the_workload_is(default: Workload | None) -> None:
    """It had said "is missing from the train config: wrap the server's strategy in LoadBalanced" (it was wrapped),
    or, with a default, run the default workload."""
    msg = _message("config", **{"train-config": ConfigRecord({"lr": 0.1})})
    with pytest.raises(ConfigError, match=r"config_key 'train-config' names no ConfigRecord .* lbbsp's workload is in "
                                          r"ConfigRecord 'config': pass config_key='config', or leave it None"):
        LocalRound(msg, config_key="train-config", default=default)
    with pytest.raises(ConfigError, match=r"config_key 'nope' .* lbbsp's workload is in ConfigRecord 'config'"):
        LocalRound(msg, config_key="nope", default=default)
    assert LocalRound(msg, config_key="config").workload == Workload(4, 2)  # the right name, given or found
    assert LocalRound(msg).workload == Workload(4, 2)


def test_a_config_key_of_no_record_under_a_plain_strategy_lists_the_records() -> None:
    LocalGrid(ClientApp(), [{}])
    msg = Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": ConfigRecord({"lr": 0.1})}),
                  dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(ConfigError, match=r"config_key 'cfg' .*: the message's ConfigRecords are \['config'\]"):
        LocalRound(msg, config_key="cfg", default=Workload(2, 1))
    # the user's own record, named, under a plain strategy: its default runs, as before
    assert LocalRound(msg, config_key="config", default=Workload(2, 1)).workload == Workload(2, 1)


def test_an_lbbsp_metric_in_the_reply_is_told_apart_from_the_weight_key() -> None:
    """Both had been told to pass their data size as LocalRound(data_size=...), which fits num-examples only."""
    rnd = LocalRound(_message())
    for _ in rnd.batches():
        pass
    with pytest.raises(ConfigError, match=r"metrics must not set \['lbbsp-samples'\]: keys that start with 'lbbsp-' "
                                          r"are lbbsp's own .*; rename yours$") as own:
        rnd.reply(ArrayRecord([np.zeros(1)]), {"lbbsp-samples": 3})
    assert "data_size" not in str(own.value)
    with pytest.raises(ConfigError, match=r"metrics must not set \['num-examples'\]: .*LocalRound\(data_size=\.\.\.\)"):
        rnd.reply(ArrayRecord([np.zeros(1)]), {"num-examples": 3})


def _failed_round(redis_url: str, job: str, reason: str, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    """Node 2's error reply with ``reason`` beside node 1's good one: the warning LoadBalanced logs for node 2, and
    the reason the history stores."""
    caplog.set_level(logging.INFO)
    _, stored = error_reply_round(redis_url, job, reason)
    (logged,) = [r.getMessage() for r in caplog.records if "node 2 failed" in r.getMessage()]
    return logged, stored


@pytest.mark.timeout(60)
def test_a_client_error_of_lbbsp_keeps_its_fix(redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Cut at 200 characters, "... passed as LocalRound(data_size=...); pas" had lost "pass yours there"."""
    reason = "ConfigError: " + "x" * 300 + "; pass yours there and leave these keys out"
    logged, stored = _failed_round(redis_url, job, reason, caplog)
    assert logged.endswith(reason) and stored == reason


@pytest.mark.timeout(60)
def test_a_legacy_client_s_key_error_says_to_move_to_the_message_api(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    logged, _ = _failed_round(redis_url, job, "KeyError: 'fitins.parameters'", caplog)
    assert logged.endswith("KeyError: 'fitins.parameters' (a legacy NumPyClient or client_fn ClientApp: LoadBalanced "
                           "sends Message API rounds; move the ClientApp to @app.train() with LocalRound, "
                           "docs/flower.md)"), logged


@pytest.mark.timeout(60)
def test_local_grid_logs_a_raising_client_apps_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A SuperNode logs it; LocalGrid had left only the server's one line, which says what, not where."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: object) -> Message:
        raise ValueError("the client's data is gone")

    with caplog.at_level(logging.ERROR, logger="flwr"):
        replies, _ = send_one(client, timeout=30)
    assert replies[0].has_error()
    (logged,) = [r.getMessage() for r in caplog.records if "LocalGrid: the ClientApp of node" in r.getMessage()]
    assert "Traceback (most recent call last)" in logged and "in _train" in logged, logged
    assert logged.endswith("ValueError: the client's data is gone"), logged
