"""LB-BSP for PyTorch DDP: agreed per-rank batch sizes, weighted gradients, honest compute timing.

An adapter only: it times each rank's compute, reports it through :class:`~lbbsp.WorkerClient`, fetches the
agreed vector, applies it through :class:`~lbbsp.GlobalBatchSampler`, and weights gradients by ``b_i / B``.
The balancing itself is the coordinator's, which runs in a child process started by rank 0 unless told otherwise.

    lb = Balancer.from_env(global_batch=256)          # after dist.init_process_group
    loader = lb.loader(dataset, num_workers=2)        # instead of DataLoader + DistributedSampler
    model = lb.attach(DDP(model))                     # weighted all-reduce + timing hook
    ...                                               # the training loop is unchanged
    lb.close()                                        # on every rank, before destroy_process_group
"""
from __future__ import annotations

import functools
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lbbsp.config import JobConfig
from lbbsp.coordinator import CoordinatorProcess
from lbbsp.embedded import EmbeddedRedis
from lbbsp.errors import ConfigError, LBBSPError
from lbbsp.policies import Policy
from lbbsp.protocol import Assignment, Report
from lbbsp.sampling import GlobalBatchSampler
from lbbsp.store import Store
from lbbsp.telemetry import ResourceMonitor
from lbbsp.worker import WorkerClient

from .torch_data import BalancedLoader
from .torch_grad import (
    BatchNormWarning,
    ComputeClock,
    all_reduce_gradients,
    batch_norm_layers,
    check_batch_norm,
    check_weighting,
    scaled_loss,
    timing_hook,
    weighted_hook,
)

log = logging.getLogger("lbbsp.torch")

__all__ = ["BalancedLoader", "Balancer", "BatchNormWarning", "Step", "agree_with_rank0", "batch_norm_layers"]


@dataclass(frozen=True)
class Step:
    """The step in progress: its global iteration, the split in use (short final batch scaled) and our share."""

    iteration: int
    split: tuple[int, ...]
    samples: int
    assignment: Assignment

    @property
    def total(self) -> int:
        return sum(self.split)


class Balancer:
    """One rank's LB-BSP session: the agreed sizes, the gradient weight and the reports of each step.

    Build it with :meth:`from_env` on every rank after ``dist.init_process_group``. ``begin_step`` is
    called by :class:`BalancedLoader`; the hooks installed by :meth:`attach` (or
    :meth:`all_reduce_gradients` without DDP) mark the end of compute and send the report.
    """

    def __init__(self, client: WorkerClient, *, group: Any = None, device: torch.device | None = None,
                 coordinator: CoordinatorProcess | None = None, owned: Sequence[Any] = ()) -> None:
        self.client = client
        self.config = client.config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device if device is not None else torch.device("cpu")
        self.coordinator = coordinator
        self.weighting: str | None = None
        self.step: Step | None = None
        self.last_report: Report | None = None
        self._owned = list(owned)  # stores and servers this balancer made, closed in reverse order
        self._iteration = 0
        self._clock = ComputeClock(self.device)
        self._reported = True
        self._monitor = ResourceMonitor(self.device.index if self.device.type == "cuda" else None)
        self._closed = False

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, global_batch: int, *, redis: str | None = None, job: str | None = None,
                 coordinator: bool = True, policy: Policy | None = None, min_batch: int = 1,
                 max_batch: int | Sequence[int] | None = None, assignment_timeout_s: float = 10.0,
                 device: torch.device | str | None = None) -> Balancer:
        """Join the job from a running process group (torchrun's env:// or any other rendezvous).

        ``redis`` (or ``$LBBSP_REDIS_URL``) names the Redis; without one, rank 0 starts an embedded server,
        which only ranks on the same machine can reach. ``coordinator=False`` means an external
        ``lbbsp coordinator`` serves the job, and then ``job`` must be its name. Without ``job``, rank 0 picks
        a fresh name so that a rerun never reads the assignments of an earlier one.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call dist.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(device) if device is not None else _collective_device()
        url = redis or os.environ.get("LBBSP_REDIS_URL")
        if not coordinator and job is None:
            raise ConfigError("with an external coordinator (coordinator=False), pass the job name it serves")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if url is None and local != world:
            raise ConfigError(f"an embedded Redis on rank 0 is reachable from its own machine only, but "
                              f"{world - local} ranks run elsewhere; pass redis='redis://host:port'")
        owned: list[Any] = []
        shared: list[str | None] = [url, job]
        if rank == 0:
            if url is None:
                server = EmbeddedRedis()
                owned.append(server)
                shared[0] = server.url
            shared[1] = job or f"torch-{uuid.uuid4().hex[:12]}"
        dist.broadcast_object_list(shared, src=0)  # two strings: the Redis URL and the job name
        url, job = str(shared[0]), str(shared[1])
        caps = tuple(max_batch) if isinstance(max_batch, Sequence) else max_batch
        config = JobConfig(job, world, global_batch, min_batch=min_batch, max_batch=caps,
                           assignment_timeout_s=assignment_timeout_s)
        store = Store.from_url(url, job, ttl_s=config.ttl_s)
        owned.append(store)
        running = None
        if rank == 0 and coordinator:  # a child process: no GIL or pinned core shared with this rank
            running = CoordinatorProcess(url, config, policy)
        client = WorkerClient(store, config, rank, agree=functools.partial(agree_with_rank0, device=device),
                              device=device_label(device))
        return cls(client, device=device, coordinator=running, owned=owned)

    # -- the data side --------------------------------------------------------------------------------------
    def loader(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
               **dataloader_kwargs: Any) -> BalancedLoader:
        """A loader of this rank's slices; DataLoader options (num_workers, pin_memory, collate_fn) pass through."""
        return BalancedLoader(dataset, self, shuffle=shuffle, seed=seed, drop_last=drop_last, **dataloader_kwargs)

    def begin_step(self, sampler: GlobalBatchSampler, step: int) -> np.ndarray:
        """Close the previous step, agree on this step's vector, start the clock; our dataset indices."""
        if self.weighting == "hook" and not self._reported and not self._clock.stopped:
            raise LBBSPError("a step ended without a synchronised backward (gradient accumulation with no_sync?); "
                             "the hook form would weight accumulated gradients by one step's share: use "
                             "attach(model, weighting='loss') and scale_loss(loss)", job=self.config.job,
                             worker=self.rank, iteration=self._current().iteration)
        self._finish_step()
        assignment = self.client.assignment(self._iteration)
        split = sampler.split_for(step, assignment.sizes)
        indices = sampler.worker_indices(step, assignment.sizes, self.rank)
        self.step = Step(self._iteration, split, len(indices), assignment)
        self._iteration += 1
        self._reported = False
        self._clock.start()
        return indices

    # -- the gradient side ----------------------------------------------------------------------------------
    def attach(self, model: DistributedDataParallel, weighting: str = "hook") -> DistributedDataParallel:
        """Install the gradient hook on a DDP model; ``weighting='loss'`` if you call :meth:`scale_loss`.

        Use ``'hook'`` (the default) to keep the training loop unchanged. Use ``'loss'`` with gradient
        accumulation (``no_sync``) or SyncBatchNorm: the weight then travels with each backward.
        """
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(f"attach expects a DistributedDataParallel model, got {type(model).__name__}; "
                              "without DDP call all_reduce_gradients(model.parameters()) after backward")
        self.weighting = check_weighting(weighting)
        check_batch_norm(model.module, weighting)
        model.register_comm_hook(self, weighted_hook if weighting == "hook" else timing_hook)
        return model

    def scale_loss(self, loss: torch.Tensor, samples: int | None = None) -> torch.Tensor:
        """The local mean loss times ``W * b_i / B`` (``samples`` for a micro-batch of the slice)."""
        step = self._current()
        if self.weighting == "hook":
            raise ConfigError("scale_loss with the weighted hook would weight twice; attach(..., weighting='loss')")
        return scaled_loss(loss, step.samples if samples is None else samples, step.total, self.world_size)

    def gradient_weight(self) -> float:
        """``b_i / B`` of the step in progress."""
        step = self._current()
        return step.samples / step.total

    def all_reduce_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """For code without DDP: after backward, set every grad to ``sum_i (b_i / B) grad_i``."""
        all_reduce_gradients(self, parameters)

    def compute_finished(self) -> None:
        """Stop this step's compute clock (the first call of a step counts)."""
        if self.step is not None:
            self._clock.stop()

    def gradients_ready(self) -> None:
        """Mark the end of this step's compute; on CPU, report at once (before any wait for other ranks)."""
        if self.step is None:
            return
        self._clock.stop()
        if not self._clock.cuda:
            self._finish_step()

    # -- reports ------------------------------------------------------------------------------
    def _finish_step(self) -> None:
        """Report the step in progress once: compute until gradients were ready, or until now."""
        if self._reported or self.step is None:
            return
        self._reported = True
        self._clock.stop()
        self.last_report = self.client.report(self.step.iteration, self.step.samples, self._clock.seconds(),
                                              features=self._monitor.sample())

    def _current(self) -> Step:
        if self.step is None:
            raise LBBSPError("no step in progress: draw batches from Balancer.loader(...)", job=self.config.job,
                             worker=self.rank)
        return self.step

    # -- shutdown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Report the last step, wait for every rank, then stop what this rank started; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_step()
            self.client.close()
            if dist.is_initialized():
                dist.barrier()  # nobody still talks to the Redis or coordinator that rank 0 is about to stop
        finally:
            if self.coordinator is not None:
                self.coordinator.stop()
            for resource in reversed(self._owned):
                resource.close()

    def __enter__(self) -> Balancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def agree_with_rank0(assignment: Assignment, *, device: torch.device) -> Assignment:
    """Every rank uses rank 0's vector, whatever each one read from Redis (a broadcast of W integers)."""
    sizes = torch.tensor(assignment.sizes, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=0)
    agreed = tuple(int(s) for s in sizes.tolist())
    if agreed == assignment.sizes:
        return assignment
    log.warning("rank %d read %s for iteration %d; using rank 0's %s", dist.get_rank(), assignment.sizes,
                assignment.iteration, agreed)
    return Assignment(assignment.job, assignment.iteration, agreed, assignment.policy,
                      "rank 0's vector, agreed over the process group", fallback=True)


def device_label(device: torch.device) -> str:
    """What a rank reports as its device: "cuda:<GPU model>" on a GPU, so that a joining worker's cold-start
    prior comes from workers with the same GPU model, and the device type elsewhere ("cpu")."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_name(device)}"[:64]


def _collective_device() -> torch.device:
    """Where tensors for the default group's collectives live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
