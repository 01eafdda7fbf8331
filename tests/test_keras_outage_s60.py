"""A Redis outage during Keras ``model.fit`` (real TensorFlow, the session's own embedded redis-server stopped with
SIGSTOP mid-fit), and ``WorkerSession``'s connect timeout against a server that accepts and never answers."""
from __future__ import annotations

import socket
import time

import pytest

from lbbsp import JobConfig
from lbbsp.errors import StoreUnavailable

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import WorkerSession, keras_module

keras = keras_module()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_connect_timeout_s_holds_against_a_server_that_never_answers(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: WorkerSession(connect_timeout_s=1) against an endpoint that accepts and never answers raised after
    10.1 s (a ping at a 3.3 s socket timeout with two retries), saying 'did not answer within 1s'."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel accepts the connections; nothing ever answers
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 1s"):
            WorkerSession(JobConfig(job, num_workers=1, global_batch=8), 0, url=url, connect_timeout_s=1)
        waited = time.monotonic() - began
    assert waited < 2.0, waited
