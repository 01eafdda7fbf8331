"""Gradient weighting and compute timing for LB-BSP under torch.distributed.

(No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations as real objects.)

With unequal local batches, the update must be the gradient of the mean loss over the whole global batch:
``sum_i (b_i / B) * g_i``, where ``g_i`` is rank i's gradient of its local mean loss. Two forms give it:

* **loss** form: multiply the local mean loss by ``W * b_i / B``; DDP's usual mean over W ranks finishes
  the job. Weights are baked into each backward, so gradient accumulation (``no_sync``) and batch
  statistics shared across ranks (SyncBatchNorm) stay exact.
* **hook** form: a DDP communication hook multiplies each gradient bucket by ``b_i / B`` and sums. The
  training code stays untouched, but the weight applies to whatever the bucket holds, so it is exact only
  when each synchronised backward covers one step of one rank's own samples.

Both forms use a hook for timing: the hook of DDP's last bucket fires when every gradient is computed and
before any wait for the slower ranks, which is where this rank's compute time ends.
"""

import functools
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lbbsp.errors import ConfigError, LBBSPError

if TYPE_CHECKING:
    from .torch import Balancer

WEIGHTINGS = ("hook", "loss")


class BatchNormWarning(UserWarning):
    """Plain BatchNorm normalises each rank's slice alone, so unequal slices change the update."""


_warned_batch_norm = False


def batch_norm_layers(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the plain BatchNorm layers and of the SyncBatchNorm layers in ``model``."""
    plain, synced = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.SyncBatchNorm):
            synced.append(name)
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            plain.append(name)
    return plain, synced


def check_batch_norm(model: nn.Module, weighting: str) -> None:
    """Warn once about plain BatchNorm; refuse SyncBatchNorm with the hook form, which it makes inexact."""
    global _warned_batch_norm  # noqa: PLW0603  (warn once per process)
    plain, synced = batch_norm_layers(model)
    if synced and weighting == "hook":
        raise ConfigError(
            f"SyncBatchNorm layers ({', '.join(synced[:3])}) share batch statistics across ranks, so each "
            "rank's gradient also carries the other ranks' losses and a per-rank weight cannot be applied "
            "afterwards; use attach(model, weighting='loss') and scale_loss(loss)")
    if plain and not _warned_batch_norm:
        _warned_batch_norm = True
        warnings.warn(
            f"the model has plain BatchNorm layers ({', '.join(plain[:3])}{', ...' if len(plain) > 3 else ''}): "
            "each rank normalises its own slice, and lbbsp gives ranks slices of different sizes, so the update "
            "is no longer exactly that of BSP on the global batch. Convert with "
            "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) (GPU) and use weighting='loss' for exact "
            "updates. BatchNorm1d (and any BatchNorm on 1x1 feature maps) cannot train on one sample: pass "
            "min_batch=2 to Balancer.from_env and drop_last=True to its loader. Layers kept in eval mode "
            "(frozen statistics) are exact.", BatchNormWarning, stacklevel=3)


#: A DDP communication hook: (its state, a bucket) -> a future of the bucket's reduced gradients.
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def scaled_loss(loss: torch.Tensor, samples: int, total: int, world_size: int) -> torch.Tensor:
    """``loss * W * samples / total``; for no samples a zero that still carries the graph (mean of none is NaN)."""
    if samples == 0:
        return torch.nan_to_num(loss) * 0.0
    return loss * (world_size * samples / total)


def weighted_hook(balancer: "Balancer", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``sum_i (b_i / B) g_i``; marks the end of compute at the last bucket."""
    _check_open(balancer)
    return _all_reduce(balancer, bucket, balancer.gradient_weight())


def timing_hook(balancer: "Balancer", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for the loss form: DDP's own mean, plus the end of compute at the last bucket."""
    _check_open(balancer)
    return _all_reduce(balancer, bucket, 1.0 / balancer.world_size)


def chained_hook(hook: CommHook, state: object, weighting: str) -> Callable[["Balancer", dist.GradBucket],
                                                                            torch.futures.Future[torch.Tensor]]:
    """A DDP comm hook that weights each bucket as lbbsp's do, then hands it to the script's own ``hook`` (with its
    ``state``), which reduces the mean over the ranks as DDP's hooks do (fp16 or bf16 compression, PowerSGD):
    ``W * b_i / B`` times the mean is the weighted sum, and the loss form's loss carries that weight already. The
    form is the model's ``weighting`` as attached (another model may be attached in the other)."""

    def lbbsp_then_hook(balancer: "Balancer", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        _check_open(balancer)
        weight = balancer.gradient_weight() * balancer.world_size if weighting == "hook" else 1.0
        return _all_reduce(balancer, bucket, weight, lambda: hook(state, bucket))

    lbbsp_then_hook.__qualname__ = f"lbbsp+{getattr(hook, '__qualname__', type(hook).__name__)}"  # DDP logs it
    return lbbsp_then_hook


def _check_open(balancer: "Balancer") -> None:
    """A hook outlives its Balancer (DDP cannot remove one): after close it must stop, not weight stale sizes;
    and a gradient is weighted only while its step is open (the share of an ended step is not its batch's)."""
    if balancer.closed:
        raise LBBSPError("this DDP model's gradient hook belongs to a closed Balancer, and DDP keeps one hook per "
                         "model: to train on with a new Balancer (a new global batch, a new job), wrap the module "
                         "in a new DistributedDataParallel and attach that", job=balancer.config.job,
                         worker=balancer.rank)
    balancer._open_step()


def _all_reduce(balancer: "Balancer", bucket: dist.GradBucket, weight: float,
                reduce: Callable[[], torch.futures.Future[torch.Tensor]] | None = None,
                ) -> torch.futures.Future[torch.Tensor]:
    """Weight the bucket, and sum it over the ranks (or ``reduce`` it, a script's own hook); the compute's clock
    stops at the last bucket, before any communication, and its report is queued while the reduction runs."""
    last = bucket.is_last()
    if last:
        balancer.compute_finished()  # the clock stops before any communication
    buffer = bucket.buffer()
    if weight == 0.0:
        buffer.zero_()  # an empty slice: its mean is undefined, its share is nothing
    else:
        buffer.mul_(weight)
    if reduce is not None:
        future = reduce()
    else:
        future = dist.all_reduce(buffer, group=balancer.group, async_op=True).get_future().then(
            lambda fut: fut.value()[0])
    if last:
        balancer.gradients_ready()  # the report is built and queued while the all-reduce runs
    return future


def all_reduce_gradients(balancer: "Balancer", parameters: Iterable[nn.Parameter]) -> None:
    """Without DDP: sum ``(b_i / B) * grad`` over ranks in one flat all-reduce; missing grads count as zero, and
    a parameter no rank has a gradient for keeps none (as in one process and under DDP: a zero gradient would still
    move it by momentum and weight decay). The flat tensor ends with how many ranks hold each parameter's grad."""
    balancer._open_step()
    balancer.gradients_ready()
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    weight = balancer.gradient_weight()
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    held = [p.grad is not None for p in params]
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads])  # the dtype torch.cat gives them
    flat = torch.cat([*grads, torch.tensor(held, dtype=dtype, device=grads[0].device)])  # one copy of the grads
    weighted = flat[:-len(params)]  # the counts after the gradients are not weighted
    if weight == 0.0:  # no samples here: nothing of this rank's counts (not even a NaN times 0)
        weighted.zero_()
    else:
        weighted.mul_(weight)
    dist.all_reduce(flat, group=balancer.group)
    # read back (a sync on a GPU) only where this rank lacks a gradient
    holders = [1.0] * len(params) if all(held) else flat[-len(params):].tolist()
    offset = 0
    for p, holding in zip(params, holders):
        n = p.numel()
        chunk = flat[offset:offset + n].view_as(p)
        if p.grad is not None:
            p.grad.copy_(chunk)
        elif holding > 0:
            p.grad = chunk.to(p.dtype, copy=True)  # torch.cat promoted mixed dtypes to the widest
        offset += n


def _collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors for ``group``'s collectives (the default group's for None) live: the current GPU under
    NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ComputeClock:
    """Measures one step's compute: wall time on CPU, CUDA events on the model's GPU (read once the step is over:
    the host only queues the GPU's work, so its own clock would time the queueing), less
    the spans between :meth:`pause` and :meth:`resume` (a collective inside the step, such as DDP's buffer
    broadcast at the start of each forward, where a fast rank waits for a slow one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._start: float | torch.cuda.Event = 0.0
        self._end: float | torch.cuda.Event | None = None
        self._paused_at: float | torch.cuda.Event | None = None
        self._pauses: list[tuple[float, float] | tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the model's GPU, which need not be the current one
        return event

    def start(self) -> None:
        """Start timing a new step (what an earlier one measured is dropped)."""
        self._end, self._paused_at, self._pauses = None, None, []
        self._start = self._now()

    def pause(self) -> None:
        """Leave out what follows, until :meth:`resume`; nothing while the clock is stopped or paused."""
        if self._end is None and self._paused_at is None:
            self._paused_at = self._now()

    def resume(self) -> None:
        """Count what follows again, after :meth:`pause`; nothing when the clock is not paused."""
        if self._paused_at is not None:
            self._pauses.append((self._paused_at, self._now()))  # type: ignore[arg-type]
            self._paused_at = None

    def stop(self, *, at_pause: bool = False) -> None:
        """Mark the end of compute (first call wins): now, or ``at_pause`` where the clock is paused (a backward
        under no_sync ended there)."""
        if self._end is not None:
            return
        if at_pause and self._paused_at is not None:
            self._end, self._paused_at = self._paused_at, None
            return
        self._paused_at = None  # a pause never resumed (no wrapped forward ran) is counted as compute, as before
        self._end = self._now()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` has marked the end of this step's compute."""
        return self._end is not None

    @property
    def ready(self) -> bool:
        """Whether :meth:`seconds` can answer without blocking the host."""
        return self._end is not None and (not self.cuda or self._end.query())  # type: ignore[union-attr]

    def seconds(self) -> float:
        """The step's compute seconds less its pauses; waits for the GPU's end event, and is a
        :class:`ConfigError` before :meth:`stop`."""
        if self._end is None:
            raise ConfigError("the compute clock was read before it was stopped")
        if self.cuda:
            with torch.cuda.device(self.device):  # from another thread too: no context made on the current GPU
                self._end.synchronize()  # type: ignore[union-attr]
            paused = sum(a.elapsed_time(b) for a, b in self._pauses) / 1e3  # type: ignore[union-attr, arg-type]
            return self._start.elapsed_time(self._end) / 1e3 - paused  # type: ignore[union-attr, arg-type]
        return float(self._end - self._start) - sum(b - a for a, b in self._pauses)  # type: ignore[operator, misc]


def check_weighting(weighting: str) -> str:
    """``weighting`` if :meth:`Balancer.attach` knows it (``"hook"`` or ``"loss"``), else a :class:`ConfigError`."""
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting
