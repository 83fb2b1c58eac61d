"""Host <-> device transfers that never make the host wait for the device.

A step's integers go up, and its sampled ids come down, through pinned host buffers reused
round-robin: copies from pageable memory wait for all queued device work, and allocating
pinned memory per step (cudaHostAlloc) can stall the host too. On CPU there is nothing to do.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


class SlotRing:
    """Reusable host buffers. A slot is free again once its copy has finished (its event)
    and, for a result, once the host has read it (`release`): a result buffer is never
    overwritten before it is read, however many steps are in flight (the ring grows)."""

    def __init__(self, num_slots: int, slot_bytes: int, alloc: Callable[[int], torch.Tensor]):
        self.alloc = alloc
        self.buffers = [alloc(slot_bytes) for _ in range(num_slots)]
        self.events: list = [None] * num_slots  # the copy into or out of the slot
        self.held = [False] * num_slots  # a result the host has not read yet
        self.next = 0

    def acquire(self, nbytes: int, hold: bool) -> int:
        """A slot of at least nbytes; `hold`: it stays taken until release()."""
        n = len(self.buffers)
        for k in range(n):
            i = (self.next + k) % n
            if not self.held[i]:
                break
        else:  # every slot holds an unread result: add one
            i = n
            self.buffers.append(self.alloc(nbytes))
            self.events.append(None)
            self.held.append(False)
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:  # with a few steps in flight it finished long ago
            self.events[i].synchronize()
            self.events[i] = None
        if self.buffers[i].numel() < nbytes:  # rare: a larger step than any before
            self.buffers[i] = self.alloc(max(nbytes, 2 * self.buffers[i].numel()))
        self.held[i] = hold
        return i

    def release(self, i: int) -> None:
        self.held[i] = False


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class Staging:
    def __init__(self, device: torch.device, num_slots: int = 32, slot_bytes: int = 1 << 20):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.ring = SlotRing(num_slots, slot_bytes, _pinned) if self.is_cuda else None

    def _host_view(self, i: int, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        return self.ring.buffers[i][:nbytes].view(like.dtype).view(like.shape)

    def _mark(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self.ring.events[i] = event

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(np.ascontiguousarray(array))
        if not self.is_cuda:
            return src
        nbytes = src.numel() * src.element_size()
        i = self.ring.acquire(nbytes, hold=False)
        host = self._host_view(i, nbytes, src)
        host.copy_(src)
        out = host.to(self.device, non_blocking=True)
        self._mark(i)
        return out

    def to_host(self, tensor: torch.Tensor | None, parse: Callable = list,
                raw: bool = False) -> PendingStep:
        """The values of `tensor` once the device gets there (None: just the moment),
        turned into a result by `parse(values as lists)` (raw: `parse(the host tensor)`,
        which must copy what it keeps: the buffer is reused once read)."""
        if not self.is_cuda:
            empty = torch.empty(0, dtype=torch.long)
            return PendingStep(tensor if tensor is not None else empty, parse=parse, raw=raw)
        if tensor is None:
            pending = PendingStep(torch.empty(0, dtype=torch.long), parse=parse)
        else:
            nbytes = tensor.numel() * tensor.element_size()
            i = self.ring.acquire(nbytes, hold=True)
            host = self._host_view(i, nbytes, tensor)
            host.copy_(tensor, non_blocking=True)
            self._mark(i)
            pending = PendingStep(host, lambda: self.ring.release(i), parse, raw)
        pending.event = torch.cuda.Event()
        pending.event.record()
        return pending


class PendingStep:
    """A step's sampled ids on their way back to the host (empty on a stage that does not
    sample: then it only marks the end of the step's device work)."""

    def __init__(self, host: torch.Tensor, release: Callable[[], None] | None = None,
                 parse: Callable = list, raw: bool = False):
        self.host, self.raw = host, raw
        self.event: torch.cuda.Event | None = None
        self._release = release
        self._parse = parse
        self._values = None
        # the step launched before, when results must be read in step order (its parse
        # advances grammar matchers): read first, whichever thread reads this one
        self.before: PendingStep | None = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def result(self):
        with self._lock:  # the worker's loop and its launcher thread may both read it
            if self._values is None:
                if self.before is not None:
                    self.before.result()
                    self.before = None
                self.wait()
                self._values = self._parse(self.host if self.raw else self.host.tolist())
            if self._release is not None:  # read: its buffer may be reused
                self._release()
                self._release = None
        return self._values
