"""The worker's side of fine-tuning's pipeline: a micro-batch called off before it starts,
calls that arrive out of order, and the tensor-parallel ranks' agreement on both."""
from __future__ import annotations

import pytest
import torch

from tests.engine_harness import InProcessEngine
from tests.test_finetune import base  # noqa: F401  (the fixture)


def test_a_worker_skips_a_micro_batch_called_off_before_it_starts(base):
    """The worker's side of `skip_ahead`: a called-off micro-batch changes nothing (its
    gradients are not accumulated), and the next one runs."""
    import asyncio
    engine = InProcessEngine(model=base, dtype="float32")
    worker = engine.worker
    worker._finetune("start", "job", 4, 16, ["q_proj"], 1e-2, 0)
    b = worker.trainers["job"].params["0", "q_proj"][1]  # A's gradient is 0 while B is
    seq, mask = [7, 8, 9, 10, 11, 12], [False, False, True, True, True, True]
    asyncio.run(worker.skip_training(1))
    out = worker._finetune("micro_step", "job", 1, -1, 0, [seq], [mask], 4, False)
    assert out["skipped"] and not b.grad.any()
    out = worker._finetune("micro_step", "job", 2, -1, 0, [seq], [mask], 4, False)
    assert out["tokens"] == 6 and b.grad.any()


class PeerRank:
    """A second tensor-parallel rank, as `all_reduce` lets one rank see it: its flags are
    added to this rank's, and the calls are counted."""

    def __init__(self, real, flags):
        self.real, self.flags, self.calls = real, torch.tensor(flags), 0
        self.tp_size = 2

    def all_reduce(self, t):
        self.calls += 1
        return t + self.flags

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_tensor_parallel_ranks_agree_on_a_call_off_and_on_a_failed_lend(base):
    """Every rank takes part in the agreement before any collective of the step, and all
    of them stop if any rank heard of a call-off or failed to lend its KV memory (a rank
    left alone in a collective would wait forever)."""
    worker = InProcessEngine(model=base, dtype="float32").worker
    worker._finetune("start", "job", 4, 16, ["q_proj"], 1e-2, 0)
    b = worker.trainers["job"].params["0", "q_proj"][1]
    seq, mask = [7, 8, 9, 10, 11, 12], [False, False, True, True, True, True]
    real = worker.runner.parallel
    worker.runner.parallel = peer = PeerRank(real, [1.0, 0.0])  # the peer heard a call-off
    out = worker._finetune("micro_step", "job", 1, -1, 0, [seq], [mask], 4, False)
    assert out["skipped"] and peer.calls == 1 and not b.grad.any()
    worker.runner.parallel = peer = PeerRank(real, [0.0, 1.0])  # the peer failed to lend
    with pytest.raises(RuntimeError, match="another tensor-parallel rank"):
        worker._finetune("micro_step", "job", 2, -1, 0, [seq], [mask], 4, False)
    assert peer.calls == 1 and not b.grad.any()

    def fail(units):
        raise RuntimeError("cuMemUnmap failed")

    worker.runner.kv_memory.lend = fail  # this rank fails: it still joins the agreement
    worker.runner.parallel = peer = PeerRank(real, [0.0, 0.0])
    with pytest.raises(RuntimeError, match="cuMemUnmap"):
        worker._finetune("micro_step", "job", 3, -1, 0, [seq], [mask], 4, False)
    assert peer.calls == 1 and not b.grad.any()


def test_a_worker_runs_a_micro_batch_sent_ahead_after_the_one_it_follows(base):
    """An async actor may start calls out of order: the one sent ahead waits for its
    predecessor to reach the launch thread."""
    import asyncio
    worker = InProcessEngine(model=base, dtype="float32").worker
    ran = []
    worker._finetune = lambda method, job_id, seq, *rest: ran.append(seq)

    async def run():
        ahead = asyncio.create_task(worker.finetune("micro_step", "job", 8, 7))  # first here
        await asyncio.sleep(0.05)
        assert not ran  # it waits for 7
        await worker.finetune("micro_step", "job", 7, -1)
        await ahead

    asyncio.run(run())
    assert ran == [7, 8]
