"""Pinned staging buffers: a result buffer is never reused before the host has read it."""
from __future__ import annotations

import pytest
import torch

from engine_actors.transfer import SlotRing, Staging


def cpu_ring(num_slots=4):
    return SlotRing(num_slots, 64, lambda n: torch.empty(n, dtype=torch.uint8))


def test_unread_results_keep_their_buffers_however_many_are_in_flight():
    ring = cpu_ring(4)
    held = [ring.acquire(8, hold=True) for _ in range(10)]  # more than the ring has
    assert len(set(held)) == 10
    ring.release(held[3])
    assert ring.acquire(8, hold=True) == held[3]  # the only free one


def test_uploads_cycle_through_the_ring():
    ring = cpu_ring(3)
    assert [ring.acquire(8, hold=False) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert ring.acquire(1000, hold=False) == 0 and ring.buffers[0].numel() >= 1000


@pytest.mark.gpu
def test_many_unread_results_on_the_gpu_keep_their_values():
    staging = Staging(torch.device("cuda"), num_slots=4)
    values = [torch.full((64,), i, device="cuda") for i in range(40)]
    pending = [staging.to_host(v) for v in values]  # none read yet
    for i, p in enumerate(pending):
        assert p.result() == [i] * 64
