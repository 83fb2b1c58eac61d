"""Host <-> device transfers that never make the host wait for the device."""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor, staged through pinned memory so the copy is asynchronous
    (a copy from pageable memory would wait for all queued device work)."""
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class PendingStep:
    """A step's sampled ids on their way back to the host (none on a stage that does not
    sample: then it only marks the end of the step's device work)."""

    def __init__(self, ids: torch.Tensor | None, device: torch.device):
        self.event = None
        self.host = ids if ids is not None else torch.empty(0, dtype=torch.long)
        if device.type == "cuda":
            if ids is not None:
                self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def result(self) -> list[int]:
        self.wait()
        return self.host.tolist()
