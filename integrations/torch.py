"""LB-BSP for PyTorch DDP: agreed per-rank batch sizes, weighted gradients, honest compute timing.

An adapter only: it times each rank's compute, reports it through :class:`~lbbsp.WorkerClient`, fetches the
agreed vector, applies it through :class:`~lbbsp.GlobalBatchSampler`, and weights gradients by ``b_i / B``.
The balancing itself is the coordinator's, which runs in a child process started by rank 0 unless told otherwise.

    lb = Balancer.from_env(global_batch=256)          # after dist.init_process_group
    loader = lb.loader(dataset, num_workers=1)        # instead of DataLoader + DistributedSampler
    model = lb.attach(DDP(model))                     # weighted all-reduce + timing hook
    ...                                               # the training loop is unchanged
    lb.close()                                        # on every rank, before destroy_process_group
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import queue
import sys
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

# Imported here, before the job's init_process_group: its functions take group=group.WORLD as a default argument,
# so a first import after init (DDP's constructor imports it through torch._dynamo) would hold the default group
# for good, destroy_process_group could not stop gloo's threads, and they would run on into interpreter exit,
# where one that frees a tensor takes the GIL and the process aborts ('terminate called without an active
# exception'). Seen with torch 2.13.
import torch.distributed.nn.functional
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from lbbsp import __version__
from lbbsp.config import JobConfig, _is_integer
from lbbsp.coordinator import MAX_AHEAD, checked_max_ahead
from lbbsp.coordinator_process import (
    EXTERNAL_MAX_AHEAD,
    EXTERNAL_POLICY,
    GRACE_BEFORE_OWN_SERVER_S,
    CoordinatorProcess,
    checked_process_policy,
)
from lbbsp.embedded import EmbeddedRedis, serve_embedded
from lbbsp.errors import ConfigError, LBBSPError
from lbbsp.policies import Policy, checked_policy
from lbbsp.protocol import Assignment, Report, _flag
from lbbsp.sampling import GlobalBatchSampler
from lbbsp.store import Store, agreed_config, redacted, redis_url, worker_socket_timeout
from lbbsp.telemetry import ResourceMonitor
from lbbsp.worker import WorkerClient

from .torch_data import BalancedLoader, meet_at_close
from .torch_grad import (
    BatchNormWarning,
    CommHook,
    ComputeClock,
    _collective_device,
    all_reduce_gradients,
    batch_norm_layers,
    chained_hook,
    check_batch_norm,
    check_weighting,
    scaled_loss,
    timing_hook,
    weighted_hook,
)

log = logging.getLogger("lbbsp.torch")
#: Every Balancer of this process, while it lives: one whose step begins inside another's is warned about.
_BALANCERS: weakref.WeakSet[Balancer] = weakref.WeakSet()

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
        """The step's global batch: the split's sum (less than ``global_batch`` in a short final batch)."""
        return sum(self.split)


class Balancer:
    """One rank's LB-BSP session: the agreed sizes, the gradient weight and the reports of each step.

    Build it with :meth:`from_env` on every rank after ``dist.init_process_group``. ``begin_step`` and
    ``end_step`` are called by :class:`BalancedLoader`; the hooks installed by :meth:`attach` (or
    :meth:`all_reduce_gradients` without DDP) mark the end of compute and send the report. An ended step
    whose gradients lbbsp did not weight raises at the next step. Use it as a context manager, or call
    :meth:`close` on every rank.
    """

    def __init__(self, client: WorkerClient, *, group: Any = None, device: torch.device | None = None,
                 coordinator: CoordinatorProcess | None = None, owned: Sequence[Any] = (),
                 redis_url: str | None = None) -> None:
        self.client = client
        self.redis_url = redis_url  # what `lbbsp status --redis` takes to watch the job (from_env sets it)
        self.config = client.config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device if device is not None else torch.device("cpu")
        self.coordinator = coordinator
        self.weighting: str | None = None
        self.step: Step | None = None
        self._last_report: Report | None = None
        self._gpu_reports = _GPUReports(self._sent)
        self._owned = list(owned)  # stores and servers this balancer made, closed in reverse order
        self._iteration = 0
        self._clock = ComputeClock(self.device)
        self._monitor = ResourceMonitor(self.device.index if self.device.type == "cuda" else None)
        self._model_device: torch.device | None = None  # where attached parameters live, timed from the next step
        self._hooks: list[RemovableHandle] = []  # forward pre-hooks on attached models, removed on close
        self._closed = False
        self._loaders: weakref.WeakSet[BalancedLoader] = weakref.WeakSet()  # closed with the Balancer
        # What the step in progress has seen, checked when it ends (see _check_weighted).
        self._open = False  # begun by the loader, not yet ended
        self._reported = True
        self._synced = False  # its gradients went through our weighting (a comm hook or all_reduce_gradients)
        self._scaled = False  # scale_loss was called
        self._unsynced_forward = False  # a DDP forward that will build gradients ran under no_sync
        self._forwarded = False  # the attached model ran a forward
        self._begun_by: GlobalBatchSampler | None = None  # the sampler (one per loader) that began the step
        self._warned_overlap = False
        _BALANCERS.add(self)
        self._ever_synced = False
        self._epoch_synced = False  # some gradient of this loader epoch went through the attached model's hook
        self._warned_gradient_free_epoch = False

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, global_batch: int, *, redis: str | None = None, job: str | None = None,
                 coordinator: bool = True, policy: Policy | None = None, min_batch: int = 1,
                 max_batch: int | Sequence[int] | None = None, assignment_timeout_s: float = 10.0,
                 device: torch.device | str | None = None, lag: int | None = None,
                 max_ahead: int | None = None) -> Balancer:
        """Join the job from a running process group (torchrun's env:// or any other rendezvous).

        ``redis`` (or ``$LBBSP_REDIS_URL``) names the Redis; without one, rank 0 starts an embedded server. Where
        ranks run on other machines (torchrun's ``LOCAL_WORLD_SIZE`` below the world size, or host names, boot ids
        or /dev/shm that differ) it also listens on TCP on every interface, behind a random password that reaches
        the ranks through the process group; a rank on rank 0's machine connects by its unix socket, any other by
        the first of rank 0's addresses that answers.
        ``coordinator=False`` means an external ``lbbsp coordinator`` serves the job on the Redis named, and then
        ``job`` must be its name; the job's ``lag`` and key TTL are then the coordinator's (``--lag``, ``--ttl``),
        and every other setting must match it. Without ``job``, rank 0 picks a fresh name so that a rerun never
        reads the assignments of an earlier one. ``lag`` (``JobConfig.lag``, 2 by default): step k's vector is
        decided from the reports of step k - lag. ``max_ahead`` (16 by default) is rank 0's coordinator's
        (:class:`lbbsp.Coordinator`): how many steps one decision may cover when deciding takes longer than a step;
        1 decides every step.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call dist.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        url, _ = redis_url(redis, "redis=")
        _same_on_every_rank(world, global_batch=global_batch, min_batch=min_batch, max_batch=max_batch,
                            assignment_timeout_s=assignment_timeout_s, coordinator=coordinator,
                            lag=JobConfig.lag if lag is None else lag, max_ahead=MAX_AHEAD if max_ahead is None
                            else max_ahead,
                            given={"redis": redacted(url) if isinstance(url, str) else url, "job": job})
        # after the ranks compared it, so that a rank's own "false" is told on every rank, not only on its own
        coordinator = _flag(coordinator, "coordinator", job)  # "false" from a command line had started one
        # (a global batch under 1 is left to JobConfig's error: no min_batch makes it one)
        if _is_integer(min_batch) and _is_integer(global_batch) and min_batch * world > global_batch >= 1:
            raise ConfigError(f"global_batch={global_batch} cannot give each of the {world} ranks min_batch="
                              f"{min_batch} samples: use a global batch of at least {min_batch * world}, or "
                              "min_batch=0 to let some ranks sit steps out with empty slices")
        device = torch.device(device) if device is not None else _collective_device()
        if not coordinator and (job is None or url is None):  # each part of the message only where it applies
            missing = " and ".join(part for part, absent in (("the job name it serves (job=)", job is None),
                                                             ("the URL of its Redis (redis= or $LBBSP_REDIS_URL)",
                                                              url is None)) if absent)
            why = (": an embedded server here would be one it cannot see" if url is None
                   else ": the name its `lbbsp coordinator --job` was given")
            raise ConfigError(f"with an external coordinator (coordinator=False), pass {missing}{why}")
        if not coordinator and policy is not None:
            raise ConfigError(EXTERNAL_POLICY, job=job)
        if not coordinator and lag is not None:
            raise ConfigError("lag= is the coordinator's: with an external one (coordinator=False), set its --lag",
                              job=job)
        if not coordinator and max_ahead is not None:
            raise ConfigError(EXTERNAL_MAX_AHEAD, job=job)
        ahead = checked_max_ahead(max_ahead, job)
        checked_policy(policy, job)  # on every rank, before any collective: rank 0 alone would leave the others hung
        owned: list[Any] = []
        running = None
        try:
            gather = functools.partial(_all_gathered, world=world)
            shared: list[Any] = [url, job or (f"torch-{uuid.uuid4().hex[:12]}" if rank == 0 else None),
                                 uuid.uuid4().hex[:12]]
            dist.broadcast_object_list(shared, src=0)  # rank 0's Redis URL and job name, and this Balancer's token
            url, job, token = shared
            if url is None:  # rank 0 serves; torchrun's LOCAL_WORLD_SIZE says where ranks run on other machines too
                server, url = serve_embedded(rank, gather, lambda listen: EmbeddedRedis(listen=listen),
                                             toward=os.environ.get("MASTER_ADDR"), who="rank",
                                             across=int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world)
                owned += [server] if server is not None else []
            config = JobConfig(job, world, global_batch, min_batch=min_batch, max_batch=max_batch,
                               assignment_timeout_s=assignment_timeout_s, **({} if lag is None else {"lag": lag}))
            checked_process_policy(policy, config)  # on every rank too: kinds outside the job, a policy not pickled
            store = Store.from_url(url, job, ttl_s=config.ttl_s,
                                   socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
            owned.append(store)
            store.ping(hint="check redis= or $LBBSP_REDIS_URL")
            if not coordinator:  # rank 0's reading, so that every rank joins the same settings
                config = config.joined(agreed_config(store, rank, gather), warn=rank == 0,
                                       caller="Balancer.from_env (num_workers is the world size)")
            if rank == 0 and coordinator:  # a child process: no GIL or pinned core shared with this rank
                running = CoordinatorProcess(url, config, policy, max_ahead=ahead)
            client = WorkerClient(store, config, rank, agree=functools.partial(agree_with_rank0, group=cpu_group()),
                                  device=device_label(device), outage_news=ProcessGroupNews.of_default_group(token))
        except BaseException:  # leave nothing running behind a failed start
            if running is not None:
                running.stop()
            for resource in reversed(owned):
                resource.close()
            raise
        return cls(client, device=device, coordinator=running, owned=owned, redis_url=url)

    # -- the data side --------------------------------------------------------------------------------------
    def loader(self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
               prefetch: bool | None = None, **dataloader_kwargs: Any) -> BalancedLoader:
        """A loader of this rank's slices; DataLoader options (num_workers, pin_memory, collate_fn) pass through.
        ``prefetch`` loads the next step's slice while this one computes (None: with loader workers; see
        :class:`BalancedLoader`)."""
        return BalancedLoader(dataset, self, shuffle=shuffle, seed=seed, drop_last=drop_last, prefetch=prefetch,
                              **dataloader_kwargs)

    def begin_step(self, sampler: GlobalBatchSampler, step: int) -> np.ndarray:
        """End the previous step, agree on this step's vector, start the clock; our dataset indices."""
        self._refuse_closed()
        self._refuse_steps_drawn_together(sampler)
        self.end_step()
        self._time_on_model_device()
        assignment = self.client.assignment(self._iteration)
        split = sampler.split_for(step, assignment.sizes)
        indices = sampler.worker_indices(step, assignment.sizes, self.rank)
        self.step = Step(self._iteration, split, len(indices), assignment)
        self._iteration += 1
        self._open, self._begun_by = True, sampler
        self._reported = self._synced = self._scaled = self._unsynced_forward = self._forwarded = False
        self._warn_overlap()
        self._clock.start()
        return indices

    def _warn_overlap(self) -> None:
        """Warn once where another Balancer's step still computes as this one's begins (two loaders zipped): each
        clock then times the other model's work as its own, and its split follows that work."""
        if self._warned_overlap or len(_BALANCERS) < 2:  # one Balancer (the usual case): no set to walk
            return
        if any(other is not self and other._open and not other._closed and not other._clock.stopped
               for other in list(_BALANCERS)):
            self._warned_overlap = True
            log.warning("job %s: a step of this Balancer began while another Balancer's step still computes (loaders "
                        "zipped?): each one's compute clock runs across the other model's work, and its split follows "
                        "that work. Draw each model's batch just before its own forward, or put both models on one "
                        "Balancer (docs/torch.md, One Balancer per DDP model); said once", self.config.job)

    def _refuse_closed(self) -> None:
        """Raise once closed, before any collective or Redis call: a step would wait out assignment_timeout_s on a
        Redis that is gone, and a loader's check of the epoch waited in a collective that ranks may never join (a
        draw on one rank after close) or that has no process group left."""
        if self._closed:
            raise LBBSPError("this Balancer is closed: draw batches before lb.close(), or start a new Balancer",
                             job=self.config.job, worker=self.rank)

    def end_step(self, *, abandoned: bool = False) -> None:
        """Report the step in progress and check that its gradients were weighted; a no-op between steps.

        :class:`BalancedLoader` calls it when a step ends: at the next step, or when its loop ends. A step
        ``abandoned`` (the loop was left early: ``break``, ``zip``, an error) is reported but not checked.
        """
        if not self._open or self._closed:
            return
        self._open = False
        self._finish_step()
        if not abandoned:
            self._check_weighted()

    def end_epoch(self) -> None:
        """Called by :class:`BalancedLoader` when an epoch's loop ends: refuse an epoch in which no gradient went
        through the attached model's hook (each step is checked too, but a step may end with no backward)."""
        synced, self._epoch_synced = self._epoch_synced, False
        if self.weighting is None or synced:
            return
        if not self._ever_synced:
            raise ConfigError("an epoch ended and no gradient went through the hook of the attached DDP model, so the "
                              "ranks' gradients were never averaged: call the DDP model for the forward "
                              "(ddp_model(x), not ddp_model.module(x)) and backpropagate at each step; to "
                              "evaluate (no backward), use a plain DataLoader, not lb.loader",
                              job=self.config.job, worker=self.rank)
        if not self._warned_gradient_free_epoch:  # an evaluation pass, most likely, after epochs that trained
            self._warned_gradient_free_epoch = True
            log.warning("an epoch of lb.loader ended with no backward through the attached model (an evaluation "
                        "pass?): its steps were timed and balanced as training steps; to evaluate, use a plain "
                        "DataLoader (said once)")

    # -- the gradient side ----------------------------------------------------------------------------------
    def attach(self, model: DistributedDataParallel, weighting: str = "hook", *, comm_hook: CommHook | None = None,
               comm_state: object = None) -> DistributedDataParallel:
        """Install the gradient hook on a DDP model; ``weighting='loss'`` if you call :meth:`scale_loss`.

        Use ``'hook'`` (the default) to keep the training loop unchanged. Use ``'loss'`` with gradient
        accumulation (``no_sync``) or SyncBatchNorm: the weight then travels with each backward. DDP takes one
        communication hook per model, so another Balancer (a new global batch) needs a new DDP wrapper, and a
        script's own hook (gradient compression: fp16, bf16, PowerSGD) is passed here as ``comm_hook`` (with its
        ``comm_state``) instead of to ``register_comm_hook``: each bucket is weighted, then handed to it. It must
        reduce the mean over the ranks, as DDP's hooks do.
        """
        if not isinstance(model, DistributedDataParallel):
            if isinstance(getattr(model, "_orig_mod", None), DistributedDataParallel):  # torch.compile(DDP(m))
                raise ConfigError("attach the DDP model before compiling it: torch.compile(lb.attach(DDP(m))), or "
                                  "lb.attach(DDP(torch.compile(m))); all_reduce_gradients would average the "
                                  "gradients DDP has averaged already, and the split would be lost")
            if _sharded(model):
                raise ConfigError(_FSDP_REFUSED)
            raise ConfigError(f"attach expects a DistributedDataParallel model, got {type(model).__name__}; "
                              "without DDP call all_reduce_gradients(model.parameters()) after backward")
        check_weighting(weighting)
        check_batch_norm(model.module, weighting)
        if comm_hook is not None and not callable(comm_hook):
            raise ConfigError(f"comm_hook must be a DDP communication hook (a function of state and bucket), got "
                              f"{type(comm_hook).__name__}", job=self.config.job, worker=self.rank)
        # (read before registering: DDP lists a hook before its reducer refuses it)
        ours = any(isinstance(state, Balancer) for _, state in getattr(model, "_comm_hooks", ()))
        hook = weighted_hook if weighting == "hook" else timing_hook
        try:
            model.register_comm_hook(self, hook if comm_hook is None else chained_hook(comm_hook, comm_state,
                                                                                       weighting))
        except RuntimeError as exc:
            if ours:
                raise ConfigError(f"DDP refused the gradient hook ({exc}): a DDP model takes one communication hook, "
                                  "and this one has lbbsp's already (an earlier attach, perhaps of another Balancer); "
                                  "wrap the module in a new DistributedDataParallel for this Balancer",
                                  job=self.config.job, worker=self.rank) from exc
            raise ConfigError("this DDP model has a communication hook already (the script's own from "
                              "register_comm_hook, a builtin one, or DDP's mixed_precision), and DDP takes one: pass "
                              "a hook of your own to lb.attach(model, comm_hook=..., comm_state=...) instead, and "
                              "lbbsp weights each bucket before handing it on", job=self.config.job,
                              worker=self.rank) from exc
        if self.weighting is not None and self.rank == 0:
            log.warning("a second DDP model is attached to this Balancer: a step's compute is timed until the last "
                        "gradient bucket of its first backward through an attached model, so the forward and backward "
                        "of a model that comes after it (a GAN's discriminator, a critic) are not timed, and the "
                        "split follows the first one's speed only (docs/torch.md, Several models)")
        self.weighting = weighting
        self._model_device = _parameter_device(model.parameters())
        if (self.rank == 0 and self._model_device is not None and self._model_device.type == "cuda"
                and self.config.max_batch is None and not expandable_segments()):
            log.warning("PyTorch's CUDA allocator runs without expandable segments: lbbsp grows a fast GPU's batch "
                        "toward its memory cap, and with fixed segments fragmentation ran out of memory below it (an "
                        "H100: 4,427 samples where 5,196 fit); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                        "before CUDA starts, or pass max_batch")
        self._hooks.append(model.register_forward_pre_hook(self._saw_forward))
        self._hooks.append(model.register_forward_hook(self._pause_after_backward))
        if model.broadcast_buffers and any(True for _ in model.module.buffers()):
            # DDP broadcasts the buffers from rank 0 before each forward: a collective, where a fast rank waits
            # for a slow one inside the step; the clock leaves it out (it stops before DDP.forward, resumes as
            # the wrapped module's forward starts, after the broadcast)
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self._clock.pause()))
            # by name and by module, not a closure over self: the module is what a script copies (an EMA's
            # deepcopy, torch.save of the whole module), and a lambda there had made torch.save fail and the copy's
            # forward resume this Balancer's clock
            _RESUMED_BY.setdefault(model.module, weakref.WeakSet()).add(self)
            self._hooks.append(model.module.register_forward_pre_hook(_resume_clocks))
        return model

    def scale_loss(self, loss: torch.Tensor, samples: int | None = None) -> torch.Tensor:
        """The local mean loss times ``W * b_i / B`` (``samples`` for a micro-batch of the slice)."""
        step = self._open_step()
        if self.weighting == "hook":
            raise ConfigError("scale_loss with the weighted hook would weight twice; attach(..., weighting='loss')")
        if getattr(loss, "_lbbsp_scaled", False):  # silently, its gradients would have been W * b_i / B too large
            raise ConfigError("this loss has been through lb.scale_loss already, and a second pass would weight its "
                              "gradients twice: call lb.scale_loss once, on the unscaled loss", job=self.config.job)
        if isinstance(samples, torch.Tensor) and samples.numel() == 1 and not samples.is_floating_point():
            samples = int(samples.item())  # a count such as mask.sum()
        if samples is not None and (not _is_integer(samples) or not 0 <= samples <= step.samples):
            raise ConfigError(f"samples must be the samples of a micro-batch of this rank's slice, an integer in "
                              f"[0, {step.samples}], got {samples!r:.40}: for a loss whose mean is over something else "
                              f"(tokens, class weights), see 'Losses that are not a mean over samples' in "
                              f"docs/torch.md", job=self.config.job)
        self._scaled = True
        scaled = scaled_loss(loss, step.samples if samples is None else int(samples), step.total, self.world_size)
        scaled._lbbsp_scaled = True  # type: ignore[attr-defined]  # what the check above reads
        return scaled

    def gradient_weight(self) -> float:
        """``b_i / B`` of the step in progress."""
        step = self._current()
        return step.samples / step.total

    def all_reduce_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """For code without DDP: after backward, set every grad to ``sum_i (b_i / B) grad_i``."""
        parameters = list(parameters)
        # FSDP2's shards, FSDP's flat parameters: all-reduce is not theirs
        if any(type(p).__name__ in ("DTensor", "FlatParameter") for p in parameters):
            raise ConfigError(_FSDP_REFUSED)
        self._model_device = _parameter_device(parameters) or self._model_device
        all_reduce_gradients(self, parameters)

    def compute_finished(self) -> None:
        """Stop this step's compute clock (the first call of a step counts)."""
        if self.step is not None:
            self._clock.stop()

    def gradients_ready(self) -> None:
        """Mark the end of this step's compute; on CPU, report at once (before any wait for other ranks)."""
        if self.step is None:
            return
        self._synced = self._ever_synced = self._epoch_synced = True
        self._clock.stop()
        if not self._clock.cuda:
            self._finish_step()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run: the hooks of a closed Balancer refuse to weight gradients."""
        return self._closed

    def _saw_forward(self, model: DistributedDataParallel, inputs: object) -> None:
        """Forward pre-hook of an attached model: note the forward, and one whose backward will not be synchronised.
        A forward counts again what followed an earlier backward of the step under no_sync."""
        self._forwarded = True
        self._clock.resume()
        if torch.is_grad_enabled() and not model.require_backward_grad_sync:
            self._unsynced_forward = True

    def _pause_after_backward(self, model: DistributedDataParallel, inputs: object, output: object) -> None:
        """Forward hook of an attached model: under no_sync no comm hook marks where the backward ends, so a hook on
        the output's gradient queues a pause of the clock for the end of the backward that reaches it (as DDP
        finds its own backward's end), and what the script does next (an all-reduce of its loss for logging, waiting
        for the slower ranks) is not counted. It had counted until the next step began. The end of the outermost
        backward: a reentrant checkpoint's nested ones end before it. Nothing is held but the hook."""
        if not torch.is_grad_enabled() or model.require_backward_grad_sync:
            return
        def reached(grad: torch.Tensor) -> None:
            torch.autograd.Variable._execution_engine.queue_callback(self._clock.pause)

        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(reached)

    def _time_on_model_device(self) -> None:
        """Time steps with CUDA events on the model's GPU, read its memory and report its model, whatever the
        backend: under gloo with a CUDA model the collective device is the CPU, so every rank had reported the
        device "cpu" and no GPU memory, and was balanced by the CPU model, with no memory cap."""
        device = self._model_device
        if device is None or device.type != "cuda" or (self._clock.cuda and self._clock.device == device):
            return
        self._clock = ComputeClock(device)
        self._monitor = ResourceMonitor(device.index)
        self.client.device = device_label(device)

    # -- reports ------------------------------------------------------------------------------
    @property
    def last_report(self) -> Report | None:
        """The last report sent; a GPU step's goes once its CUDA events are done, which this waits for."""
        self._gpu_reports.wait()
        return self._last_report

    def _sent(self, report: Report) -> None:
        self._last_report = report

    def _finish_step(self) -> None:
        """Report the step in progress once: compute until gradients were ready, or until now. A GPU step whose
        events are not done yet is reported by a thread once they are: the host goes on to queue the next step."""
        if self._reported or self.step is None:
            return
        self._gpu_reports.check()
        self._reported = True
        self._clock.stop(at_pause=True)  # a step whose last backward ran under no_sync ended with it
        features = self._monitor.sample()
        if self._clock.ready and self._gpu_reports.idle:
            self._sent(self.client.report(self.step.iteration, self.step.samples, self._clock.seconds(),
                                          features=features))
        else:
            self._gpu_reports.put(functools.partial(self.client.report, self.step.iteration, self.step.samples,
                                                    features=features), copy.copy(self._clock))

    def _check_weighted(self) -> None:
        """Refuse an ended step whose update is not the global batch's: raised at the next step, on every rank."""
        job, worker, iteration = self.config.job, self.rank, self._current().iteration
        if self.weighting is None and not self._ever_synced:
            raise ConfigError("a step ended and no gradient has gone through lbbsp's weighting, so DDP averages "
                              "slices of different sizes as if they were equal: call lb.attach(ddp_model) before "
                              "training (without DDP, lb.all_reduce_gradients(model.parameters()) after backward)",
                              job=job, worker=worker, iteration=iteration)
        if self.weighting == "loss" and (self._synced or self._unsynced_forward) and not self._scaled:
            raise ConfigError("attach(model, weighting='loss') weights nothing by itself: backpropagate "
                              "lb.scale_loss(loss) at every step, those under no_sync too (or attach with the default "
                              "weighting='hook')", job=job, worker=worker, iteration=iteration)
        if self.weighting == "hook" and self._unsynced_forward and not self._synced:
            raise LBBSPError("a step ran under no_sync and ended without a synchronised backward (gradient "
                             "accumulation?); the hook form would weight accumulated gradients by one step's "
                             "share: use attach(model, weighting='loss') and scale_loss(loss)", job=job,
                             worker=worker, iteration=iteration)

    def _refuse_steps_drawn_together(self, sampler: GlobalBatchSampler) -> None:
        """Refuse a step begun by another loader while the open step has seen neither a forward of the attached
        model nor a backward: two loaders iterated together (``zip``) each take an iteration of the job with its
        own split, and the backward would be weighted by the later one's (parameters 0.36 off single-process
        SGD, with no error). Only with an attached model, whose forwards are seen."""
        if (self._open and self.weighting is not None and sampler is not self._begun_by and not self._forwarded
                and not self._synced):
            raise ConfigError("a step of another lb.loader began while the open step had no forward and no backward: "
                              "two loaders iterated together (zip) each take a step of the job with its own split, "
                              "and the backward would be weighted by the later one's; draw one lb.loader per "
                              "training step (a Dataset that returns a sample of each, for paired data)",
                              job=self.config.job, worker=self.rank, iteration=self._current().iteration)

    def _current(self) -> Step:
        if self.step is None:
            raise LBBSPError("no step in progress: draw batches from Balancer.loader(...)", job=self.config.job,
                             worker=self.rank)
        return self.step

    def _open_step(self) -> Step:
        """The step in progress, for a gradient about to be weighted: refused once the step has ended, since its
        weight no longer belongs to the batch (``itertools.cycle`` replays batches without beginning a step, and
        they had been weighted by the last real step's share, 0.08 off single-process SGD after one pass)."""
        step = self._current()
        if not self._open:
            raise LBBSPError("a gradient was weighted after its step ended: every batch must be drawn from a loop over "
                             "lb.loader as the step trains (itertools.cycle or a list of saved batches replays them "
                             "outside any step; iterate the loader again each epoch instead)",
                             job=self.config.job, worker=self.rank, iteration=step.iteration)
        return step

    # -- shutdown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Report the last step, wait for every rank, then stop what this rank started; safe to call twice.

        While an exception propagates (a ``with`` block, a ``finally``), it releases this rank's resources
        without waiting: the other ranks may be inside a collective that this rank will never join.
        """
        if self._closed:
            return
        failing = sys.exc_info()[0] is not None
        failure: BaseException | None = None
        try:
            if not failing:
                try:
                    self.end_step(abandoned=True)
                except Exception as exc:  # noqa: BLE001  (raised below, once this rank has met the others)
                    failure = exc
            for loader in list(self._loaders):
                loader.close()
            for handle in self._hooks:
                handle.remove()
            for balancers in _RESUMED_BY.values():
                balancers.discard(self)
            self._gpu_reports.close(self.config.assignment_timeout_s if failing else None)
            failure = failure or self._gpu_reports.failure()
            self.client.close()
            if not failing and dist.is_initialized():
                meet_at_close(self)  # nobody still talks to the Redis or coordinator that rank 0 is about to stop
        finally:
            self._closed = True
            if self.coordinator is not None and any(isinstance(r, EmbeddedRedis) for r in self._owned):
                self.coordinator.stop(GRACE_BEFORE_OWN_SERVER_S)  # its Redis is this rank's own, deleted next
            elif self.coordinator is not None:
                self.coordinator.stop()
            for resource in reversed(self._owned):
                resource.close()
        if failure is not None and not failing:
            raise failure

    def __reduce_ex__(self, protocol: object) -> Any:
        raise ConfigError(_NOT_COPIED.format(what="a Balancer"), job=self.config.job, worker=self.rank)

    def __enter__(self) -> Balancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Why a Balancer, a loader of one, or a DDP model attached to one is not copied or pickled.
_NOT_COPIED = ("{what} cannot be copied or pickled: it is this rank's live part of the job (its Redis connection, "
               "the step in progress, rank 0's coordinator), and a copy would take part in the job as a second one. "
               "Copy or save the wrapped module instead (copy.deepcopy(ddp_model.module) for an EMA, "
               "torch.save(ddp_model.module.state_dict())), and the loader's position as loader.state_dict() "
               "(docs/torch.md, Checkpoints and restarts)")

#: Per wrapped module of an attached DDP model, the Balancers whose clock its forward resumes (_resume_clocks).
_RESUMED_BY: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Balancer]] = weakref.WeakKeyDictionary()


def _resume_clocks(module: nn.Module, inputs: object) -> None:
    """Forward pre-hook of an attached DDP model's wrapped module: resume the clocks paused at DDP's forward, after its
    buffer broadcast. A copy of the module (``copy.deepcopy``, ``torch.save`` of the whole module) carries this
    function, which finds no Balancer for the copy and does nothing."""
    for balancer in list(_RESUMED_BY.get(module, ())):
        balancer._clock.resume()


class _GPUReports:
    """A thread that sends the reports of GPU steps, each once its CUDA events are done, in order. Reading them at
    once would make the host wait for the GPU at every step, and the GPU then idles while the host prepares the
    next step. What sending one raised is kept for the training thread (:meth:`check`)."""

    def __init__(self, sent: Callable[[Report], None]) -> None:
        self._sent = sent
        self._queue: queue.Queue[tuple[Callable[..., Report], ComputeClock] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failures: deque[BaseException] = deque()  # appended by the thread, taken by the training thread

    @property
    def idle(self) -> bool:
        """Nothing is waiting to be sent: a report sent now keeps the order."""
        return self._queue.unfinished_tasks == 0

    def put(self, report: Callable[..., Report], clock: ComputeClock) -> None:
        """Send ``report(compute_s)`` once ``clock`` (stopped, not reused) can be read."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lbbsp-gpu-reports", daemon=True)
            self._thread.start()
        self._queue.put((report, clock))

    def check(self) -> None:
        """Raise what sending a report raised, once."""
        failure = self.failure()
        if failure is not None:
            raise failure

    def failure(self) -> BaseException | None:
        """What sending a report raised, taken (None if nothing did)."""
        return self._failures.popleft() if self._failures else None

    def wait(self) -> None:
        """Until every report put is sent; then :meth:`check`."""
        self._queue.join()
        self.check()

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued, then stop the thread, waiting at most ``timeout_s`` (a daemon left waiting for a
        GPU that will not finish, where an error is propagating)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            report, clock = item
            try:
                self._sent(report(clock.seconds()))  # seconds() waits for the events, without the GIL
            except BaseException as exc:  # noqa: BLE001  (raised in the training thread, at the next step)
                self._failures.append(exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()


#: Why a sharded model (FSDP, FSDP2's fully_shard) is refused.
_FSDP_REFUSED = ("FSDP is not supported: lbbsp weights each rank's gradients in DDP's all-reduce, and FSDP "
                 "reduce-scatters sharded gradients instead; wrap the model in DistributedDataParallel")


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP's (FullyShardedDataParallel, or a module FSDP2's ``fully_shard`` made)."""
    return any(cls.__name__ in ("FullyShardedDataParallel", "FSDPModule") for cls in type(model).__mro__)


def _same_on_every_rank(world: int, *, given: dict[str, object], **settings: object) -> None:
    """A ConfigError on every rank, naming the ranks and values, where the ranks passed from_env other ``settings``:
    rank 0's were used (its coordinator registers the job), and a rank of another global batch had died of a
    mismatch error on rank 0 that blamed a job name it had just made up, the others of the connection it left.
    ``given`` (the Redis URL, the job name) may be left out (None) on ranks other than 0, which take rank 0's; one
    given otherwise had been replaced by rank 0's unsaid, and a rank that named the right Redis by another address
    failed to reach rank 0's, blaming its own setting. The lbbsp version is compared first: a rank of another version
    had failed here with a KeyError for a setting the other did not send, or later in gloo, aborted by a collective
    of another size."""
    ours = {"lbbsp": __version__} | {name: _plain(v) for name, v in settings.items()}
    gathered: list[tuple[dict[str, object], dict[str, object]] | None] = [None] * world
    dist.all_gather_object(gathered, (ours, given))
    every = cast("list[tuple[dict[str, object], dict[str, object]]]", gathered)
    versions = [theirs[0].get("lbbsp") for theirs in every]  # None: a version from before it was compared
    if len(set(versions)) > 1:  # first: another version may gather other settings, or other collectives next
        shown = "; ".join(f"{v or 'an older one'} on rank {r}" for r, v in enumerate(versions) if v != versions[0])
        raise ConfigError(f"the ranks run different versions of lbbsp ({versions[0] or 'an older one'} on rank 0; "
                          f"{shown}): install one version on every machine, as each version's steps take part in "
                          "collectives of their own")
    differ = []
    for name in ours:
        groups: list[tuple[object, list[int]]] = []  # each value (10 and 10.0 are one; so is NaN) and its ranks
        for r, theirs in enumerate(every):
            value = theirs[0][name]
            same = next((ranks for v, ranks in groups if _same(v, value)), None)
            same.append(r) if same is not None else groups.append((value, [r]))
        if len(groups) > 1:
            differ.append(f"{name}: " + "; ".join(f"{value!r} on rank{'s' if len(ranks) > 1 else ''} "
                                                   f"{', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''}"
                                                   for value, ranks in groups[:4]))
    for name in given:
        values = [theirs[1][name] for theirs in every]
        other = [r for r, value in enumerate(values) if r and value is not None and value != values[0]]
        if other:
            differ.append(f"{name}: {values[0]!r} on rank 0, " + "; ".join(f"{values[r]!r} on rank {r}"
                                                                            for r in other[:4]))
    if differ:
        raise ConfigError("Balancer.from_env was given other settings on other ranks (" + "; ".join(differ) + "): "
                          "the job has one global batch and one split a step, so every rank must pass the same (the "
                          "Redis URL and the job name may be left out on ranks other than 0, which take rank 0's; "
                          "name a Redis by an address every rank reaches)")


def _plain(value: object) -> object:
    """A setting as plain Python, to compare across ranks: an array's or tensor's values, a sequence as a tuple."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _same(a: object, b: object) -> bool:
    """Whether two ranks' settings are one (10 and 10.0 are; so are two NaNs, and two values that do not compare but
    print alike)."""
    try:
        return bool(a == b) or repr(a) == repr(b)
    except Exception:  # noqa: BLE001  (a value whose == raises: told apart by how it prints)
        return repr(a) == repr(b)


def _all_gathered(value: str | None, *, world: int) -> list[str | None]:
    """Every rank's ``value``, in rank order."""
    values: list[str | None] = [None] * world
    dist.all_gather_object(values, value)
    return values


def agree_with_rank0(assignment: Assignment, *, group: dist.ProcessGroup | None = None) -> Assignment:
    """Every rank uses rank 0's vector, whatever each one read from Redis (a broadcast of W integers over
    ``group``, the default group for None)."""
    sizes = torch.tensor(assignment.sizes, dtype=torch.int64, device=_collective_device(group))
    dist.broadcast(sizes, src=0, group=group)
    agreed = tuple(int(s) for s in sizes.tolist())
    if agreed == assignment.sizes:
        return assignment
    if assignment.fallback:  # expected where Redis was unusable to this rank alone: its own warning said so
        log.info("rank %d fell back to %s for iteration %d; using rank 0's %s", dist.get_rank(), assignment.sizes,
                 assignment.iteration, agreed)
    else:
        log.warning("rank %d read %s for iteration %d; using rank 0's %s", dist.get_rank(), assignment.sizes,
                    assignment.iteration, agreed)
    return Assignment(assignment.job, assignment.iteration, agreed, assignment.policy,
                      "rank 0's vector, agreed over the process group", fallback=True)


class ProcessGroupNews:
    """:class:`~lbbsp.OutageNews` over the key-value store of the default process group (torchrun's TCPStore, an
    ``init_method``'s FileStore), which works while Redis does not: one key per Balancer, the latest step a rank fell
    back at, Redis being unusable. Read and written only in an outage."""

    def __init__(self, store: dist.Store, token: str) -> None:
        self._store = store
        self._key = f"lbbsp/{token}/unusable"

    @classmethod
    def of_default_group(cls, token: str) -> ProcessGroupNews | None:
        """The news of the default group's store; None where this torch does not give it (a private function)."""
        try:
            return cls(dist.distributed_c10d._get_default_store(), token)
        except (AttributeError, RuntimeError, ValueError):
            return None

    def tell(self, iteration: int) -> None:
        """This rank fell back at ``iteration``, Redis being unusable."""
        self._store.set(self._key, str(iteration))

    def heard(self, iteration: int) -> bool:
        """Whether a rank fell back so at ``iteration - 1`` or later."""
        return self._store.check([self._key]) and int(self._store.get(self._key)) >= iteration - 1


_CPU_GROUPS: dict[Any, dist.ProcessGroup] = {}  # default group -> a gloo group of the same ranks


def cpu_group() -> dist.ProcessGroup | None:
    """A process group of every rank whose collectives run on the CPU: the default group unless it is NCCL's, else
    a gloo group made once beside it (a collective: every rank calls it at the same point). Under NCCL, a broadcast
    queues behind the step's GPU work, and reading it makes the host wait for the GPU at every step, which then
    idles while the host prepares the next step (on an H100, about half of plain DDP's throughput)."""
    if _collective_device().type == "cpu":
        return None
    default = dist.distributed_c10d._get_default_group()
    if default not in _CPU_GROUPS:  # with the default group's timeout: new_group's own default is gloo's 30 minutes
        # one default group at a time: an earlier one's side group went with it (a sweep that makes and destroys a
        # process group each run had kept each run's two groups here, with their sockets)
        _CPU_GROUPS.clear()
        _CPU_GROUPS[default] = dist.new_group(backend="gloo", timeout=_group_timeout(default))
    return _CPU_GROUPS[default]


def _group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group``'s collectives run under (``init_process_group(timeout=...)`` for the default group), or
    None where this torch does not tell (read from the backend's options, which torch keeps private)."""
    try:
        timeout = group._get_backend(_collective_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def expandable_segments() -> bool:
    """Whether the environment turns on expandable segments of PyTorch's CUDA allocator (PYTORCH_CUDA_ALLOC_CONF
    or its newer name PYTORCH_ALLOC_CONF), under which the card's memory readings track what a step needs."""
    settings = os.environ.get("PYTORCH_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def _parameter_device(parameters: Iterable[torch.Tensor]) -> torch.device | None:
    """The device of the first parameter, or None for a model without parameters."""
    return next((p.device for p in parameters), None)


def device_label(device: torch.device) -> str:
    """What a rank reports as its device: "cuda:<GPU model>" on a GPU, so that a joining worker's cold-start
    prior comes from workers with the same GPU model, and the device type elsewhere ("cpu")."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_name(device)}"[:64]

