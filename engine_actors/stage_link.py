"""Hidden states and residual between neighbouring pipeline stages, without coupling them.

Each direction uses a ring of fixed buffers, one per step in flight: allocating hundreds of
MB per prefill chunk next to a full KV pool makes the allocator free its cache, which waits
for the device. On GPU, receives and sends run on their own streams. Issued on the compute
stream, torch would make step k+1's receive wait for step k's compute, and the sender then
idles until the receiver has finished its previous step: the stages would take turns
instead of overlapping. Events guard each ring slot instead, so a buffer is only reused
once its previous reader (receive side) or send (send side) is done.
"""
from __future__ import annotations

import torch

from engine_actors.parallel import ParallelGroup


class StageLink:
    def __init__(self, parallel: ParallelGroup, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, num_slots: int):
        self.parallel = parallel
        shape = (max_tokens, 2, hidden_size)  # [T, (hidden, residual), H]
        self.recv_bufs = [] if parallel.is_first_stage else [
            torch.empty(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.send_bufs = [] if parallel.is_last_stage else [
            torch.empty(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.recv_stream, self.send_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self.recv_done: list[torch.cuda.Event | None] = [None] * num_slots  # slot's reader done
        self.send_done: list[torch.cuda.Event | None] = [None] * num_slots  # slot's send done

    def recv(self, step_id: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = step_id % len(self.recv_bufs)
        buf = self.recv_bufs[slot][:num_tokens]
        if not self.is_cuda:
            self.parallel.recv_prev(buf)
            return buf[:, 0], buf[:, 1]
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.recv_stream):
            if self.recv_done[slot] is not None:
                self.recv_stream.wait_event(self.recv_done[slot])
            self.parallel.recv_prev(buf)
        compute.wait_stream(self.recv_stream)  # this step's data, nothing later
        return buf[:, 0], buf[:, 1]

    def release_recv(self, step_id: int) -> None:
        """The step's readers of its receive buffer are all enqueued on the compute stream."""
        if self.is_cuda and self.recv_bufs:
            done = torch.cuda.Event()
            done.record()
            self.recv_done[step_id % len(self.recv_bufs)] = done

    def send(self, step_id: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        slot = step_id % len(self.send_bufs)
        num_tokens = hidden.shape[0]
        buf = self.send_bufs[slot][:num_tokens]
        compute = torch.cuda.current_stream() if self.is_cuda else None
        if self.is_cuda and self.send_done[slot] is not None:
            compute.wait_event(self.send_done[slot])
        buf[:, 0].copy_(hidden)
        buf[:, 1].copy_(residual)
        if not self.is_cuda:
            self.parallel.send_next(buf)
            return
        self.send_stream.wait_stream(compute)  # the data is ready
        with torch.cuda.stream(self.send_stream):
            self.parallel.send_next(buf)
            done = torch.cuda.Event()
            done.record()
        self.send_done[slot] = done
