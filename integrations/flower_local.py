"""A Flower Grid that runs ClientApps on threads of this process: for tests and benchmarks, not deployment.

Flower's own simulation engine needs Ray. ``LocalGrid`` drives the same ``Strategy.start`` loop and the same
``ClientApp`` objects with real ``Message``s, but delivers them by function call instead of through a
SuperLink. Like a SuperNode, it hands each ClientApp its own copy of its message and turns an exception in
a ClientApp, or its exit, into an error reply; a reply that comes after ``send_and_receive``'s timeout is
dropped, as a late node's would be. Each message runs on its own daemon thread, so a ClientApp that never
returns holds neither a later round nor the interpreter's exit.
"""
from __future__ import annotations

import copy
import itertools
import math
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from logging import ERROR
from numbers import Real
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from lbbsp.errors import ConfigError

_SERVER_NODE_ID = 0


class LocalGrid(Grid):
    """One node per entry of ``node_configs`` (its ``context.node_config``), node ids 1..N."""

    def __init__(self, client_app: ClientApp, node_configs: Sequence[Mapping[str, int | float | str | bool]], *,
                 run_config: Mapping[str, int | float | str | bool] | None = None, run_id: int = 1) -> None:
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self._contexts = {
            i + 1: Context(run_id=run_id, node_id=i + 1, node_config=dict(cfg), state=RecordDict(),
                           run_config=dict(run_config or {}))
            for i, cfg in enumerate(node_configs)
        }
        self._closed = False
        self._futures: dict[str, Future[Message]] = {}
        self._ids = itertools.count()
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, _SERVER_NODE_ID, 0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        if self._closed:
            raise RuntimeError("LocalGrid is closed")
        ids = []
        for message in messages:
            message_id = f"local-{next(self._ids)}"
            future: Future[Message] = Future()
            threading.Thread(target=self._deliver, args=(message, future), daemon=True,
                             name=f"lbbsp-node-{message.metadata.dst_node_id}").start()
            self._futures[message_id] = future
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        done = [i for i in message_ids if i in self._futures and self._futures[i].done()]
        return [self._futures.pop(i).result() for i in done]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        wait([self._futures[i] for i in ids], timeout=timeout)
        replies = list(self.pull_messages(ids))
        for message_id in ids:  # late replies are dropped, as a SuperLink drops them after the round
            self._futures.pop(message_id, None)
        return replies

    def close(self) -> None:
        """Stop accepting work and return at once: ClientApps still running finish on their daemon threads,
        or end with the interpreter. Safe to call twice."""
        self._closed = True
        self._futures.clear()

    def _deliver(self, message: Message, future: Future[Message]) -> None:
        """Run the ClientApp on a copy of ``message`` and put its reply (or an error reply) in ``future``.

        The copy is what a SuperNode deserialises: the server's message shares its arrays with the global model
        and the round's other messages, which a ClientApp editing what it received would change."""
        message = copy.deepcopy(message)
        message.metadata.delivered_at = str(time.time())
        try:
            reply = self.client_app(message, self._contexts[message.metadata.dst_node_id])
            if not isinstance(reply, Message):
                raise TypeError(f"the ClientApp returned {type(reply).__name__}, not a Message (a train function "
                                f"ends with `return rnd.reply(...)`)")
        except BaseException as exc:  # noqa: BLE001  (a SuperNode reports any ClientApp exception as an error)
            # sys.exit() ends a thread silently, with no reply: the round would wait out its timeout; a SuperNode
            # replies CLIENT_APP_CRASHED for a ClientApp process that is gone
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION if isinstance(exc, Exception) else ErrorCode.CLIENT_APP_CRASHED
            reply = Message(Error(code=code, reason=f"{type(exc).__name__}: {exc}"), reply_to=message)
            # the traceback, as a SuperNode logs it: the server's one line had said what, but not where
            log(ERROR, "LocalGrid: the ClientApp of node %d raised:\n%s", message.metadata.dst_node_id,
                traceback.format_exc().rstrip())
        future.set_result(reply)

    def check_enough_nodes(self, strategy: object, purpose: str) -> None:
        """Raise a ConfigError if ``strategy`` (a FedAvg or alike) would wait for more nodes than this grid has,
        for its ``purpose`` ("train" or "evaluate"): a LocalGrid never gains one, so Flower would wait forever."""
        have = len(self._contexts)
        fraction = strategy_attribute(strategy, f"fraction_{purpose}", 0.0)
        # FedAvg samples max(int(nodes x fraction), min_<purpose>_nodes) and waits for at least that many
        sampled = int(have * float(fraction)) if isinstance(fraction, Real) and math.isfinite(fraction) else 0
        need = max(strategy_attribute(strategy, "min_available_nodes", 0),
                   strategy_attribute(strategy, f"min_{purpose}_nodes", 0), sampled)
        if isinstance(need, int) and need > have:
            raise ConfigError(f"the strategy waits for {need} nodes (min_available_nodes, min_{purpose}_nodes, and "
                              f"fraction_{purpose} {fraction!r} of the {have} nodes) and this LocalGrid has {have}, "
                              f"which it never outgrows: give the strategy min_available_nodes and "
                              f"min_{purpose}_nodes of at most {have}, and fraction_{purpose} of at most 1")


def strategy_attribute(strategy: object, name: str, default: Any) -> Any:
    """``strategy``'s attribute ``name``, else that of the strategy it wraps (``.strategy``, as Flower's DP wrappers
    and LoadBalanced keep it), and so on inwards; ``default`` if none has it. A wrapper samples with its inner
    strategy's node counts and aggregates by its keys, without holding them itself."""
    return next((getattr(s, name) for s in wrapped_chain(strategy) if hasattr(s, name)), default)


def wrapped_chain(strategy: object) -> Iterator[object]:
    """``strategy``, the strategy it wraps (``.strategy``), and so on inwards, each once."""
    seen: set[int] = set()
    while strategy is not None and id(strategy) not in seen:
        yield strategy
        seen.add(id(strategy))
        strategy = getattr(strategy, "strategy", None)
