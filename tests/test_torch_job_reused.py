"""A job name reused under torchrun on another number of ranks, with real gloo ranks: every rank of the new run is
refused with the error that says how to clear the old keys, and after `lbbsp forget` the new ranks resume from the old
run's checkpoint with one split of the global batch per step and every sample of the epoch used once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).with_name("torch_resumed.py")
SAMPLES, GLOBAL_BATCH = 240, 24


def torchrun(out: Path, ranks: int, redis: str, job: str) -> subprocess.CompletedProcess[str]:
    """Run tests/torch_resumed.py for one epoch on ``ranks`` ranks; a hang is a failure, its ranks killed with it."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(SCRIPT), str(out), redis, job, "1"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as run:
        try:
            stdout, stderr = run.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            raise
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def check_splits_and_coverage(out: Path) -> list[int]:
    """Assert one split a step on every rank of each run, of its world size and summing to the global batch, and each
    sample of the epoch used once (a later run's steps replace those after its checkpoint); each run's world size."""
    used: dict[int, list[int]] = {}
    worlds = []
    for path in sorted(out.glob("*.rank0.jsonl"), key=lambda p: p.stat().st_ctime_ns):
        lines = {rank.name: [json.loads(line) for line in rank.read_text().splitlines()]
                 for rank in out.glob(path.name.replace(".rank0.", ".rank*."))}
        world = lines[path.name][0]["world"]
        worlds.append(world)
        steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for rank in range(world):
            for line in lines[path.name.replace(".rank0.", f".rank{rank}.")][1:]:
                steps[line["step"]].append(line)
        for step, by_rank in steps.items():
            splits = {tuple(line["split"]) for line in by_rank}
            assert len(splits) == 1, (step, splits)
            split = splits.pop()
            assert len(split) == world and sum(split) == GLOBAL_BATCH, (step, split)
            assert [len(line["index"]) for line in by_rank] == list(split), step
            used[step] = [i for line in by_rank for i in line["index"]]
    assert sorted(i for index in used.values() for i in index) == list(range(SAMPLES))
    return worlds


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_name_reused_on_other_ranks_is_refused_on_each_until_forgotten(tmp_path: Path, redis_url: str,
                                                                            job: str) -> None:
    """A run of 2 ranks, then 3 under its job name: every rank stops at once with the error that says how to clear
    the old keys, not a split of 2 sizes for 3 ranks; after `lbbsp forget` the 3 ranks resume the epoch from the
    checkpoint the 2 left after its 9th global batch."""
    first = torchrun(tmp_path, 2, redis_url, job)
    assert first.returncode == 0, first.stderr[-3000:]
    refused = torchrun(tmp_path, 3, redis_url, job)
    assert refused.returncode != 0
    for rank in range(3):
        assert f"[rank{rank}]: lbbsp.errors.ConfigError: job '{job}' was started with num_workers=2 (not 3)" in \
            refused.stderr, refused.stderr[-3000:]
    forget = subprocess.run([sys.executable, "-m", "lbbsp.cli", "forget", "--job", job, "--redis", redis_url],
                            capture_output=True, text=True, timeout=60, check=False)
    assert forget.returncode == 0, forget.stderr
    again = torchrun(tmp_path, 3, redis_url, job)
    assert again.returncode == 0, again.stderr[-3000:]
    assert check_splits_and_coverage(tmp_path) == [2, 3]  # the 3 ranks trained the 10th batch, after the checkpoint
