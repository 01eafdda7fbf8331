"""One rule for which Redis a command or integration uses: the URL given, else $LBBSP_REDIS_URL, else none."""
from __future__ import annotations

import pytest

from lbbsp.store import redis_url


def test_the_given_url_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "redis://env:6379/0")
    assert redis_url("redis://flag:6379/0") == ("redis://flag:6379/0", "--redis")
    assert redis_url("unix:///tmp/r.sock", "redis=") == ("unix:///tmp/r.sock", "redis=")
    assert redis_url(None) == ("redis://env:6379/0", "$LBBSP_REDIS_URL")
    assert redis_url("") == ("redis://env:6379/0", "$LBBSP_REDIS_URL")  # an empty flag gives none


def test_an_empty_or_unset_variable_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert redis_url(None) == (None, "")
    monkeypatch.delenv("LBBSP_REDIS_URL")
    assert redis_url("") == (None, "")
