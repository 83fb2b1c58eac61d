"""Host <-> device transfers that never make the host wait for the device.

A step's integers go up, and its sampled ids come down, through pinned host buffers reused
round-robin: copies from pageable memory wait for all queued device work, and allocating
pinned memory per step (cudaHostAlloc) can stall the host too. On CPU there is nothing to do.
"""
from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, num_slots: int = 32, slot_bytes: int = 1 << 20):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                      for _ in range(num_slots)] if self.is_cuda else []
        self.in_use: list[torch.cuda.Event | None] = [None] * num_slots
        self.next = 0

    def _slot(self, nbytes: int) -> torch.Tensor:
        """A free pinned slot of at least nbytes. With a few steps in flight and 32 slots,
        the slot's previous copy finished long ago; the event wait is a guard."""
        i, self.next = self.next, (self.next + 1) % len(self.slots)
        if self.in_use[i] is not None:
            self.in_use[i].synchronize()
        if self.slots[i].numel() < nbytes:  # rare: a larger step than any before
            self.slots[i] = torch.empty(max(nbytes, 2 * self.slots[i].numel()),
                                        dtype=torch.uint8, pin_memory=True)
        self._current = i
        return self.slots[i]

    def _mark(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.in_use[self._current] = event

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(np.ascontiguousarray(array))
        if not self.is_cuda:
            return src
        host = self._slot(src.numel() * src.element_size())[:src.numel() * src.element_size()]
        host = host.view(src.dtype).view(src.shape)
        host.copy_(src)
        out = host.to(self.device, non_blocking=True)
        self._mark()
        return out

    def to_host(self, tensor: torch.Tensor | None) -> PendingStep:
        """The values of `tensor` once the device gets there (None: just the moment)."""
        if not self.is_cuda:
            return PendingStep(tensor if tensor is not None else torch.empty(0, dtype=torch.long))
        if tensor is None:
            pending = PendingStep(torch.empty(0, dtype=torch.long))
        else:
            nbytes = tensor.numel() * tensor.element_size()
            host = self._slot(nbytes)[:nbytes].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor, non_blocking=True)
            self._mark()
            pending = PendingStep(host)
        pending.event = torch.cuda.Event()
        pending.event.record()
        return pending


class PendingStep:
    """A step's sampled ids on their way back to the host (empty on a stage that does not
    sample: then it only marks the end of the step's device work)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def result(self) -> list[int]:
        self.wait()
        return self.host.tolist()
