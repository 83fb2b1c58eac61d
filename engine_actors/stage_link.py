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

import collections

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


class TokenLink:
    """The last stage's sampled ids, back into the first stage's `last_sampled` table, so a
    batch's next step can continue from them (-1 ids) before the scheduler has its result.

    Every step that samples sends its ids once. The first stage posts the matching receive
    right after sending that step's hidden states on, so both ends of the pair issue their
    operations in the same order (NCCL runs a pair's operations on one stream). On GPU the
    receive and the scatter into the table run on their own stream; a step waits only for
    the steps its continued rows come from, at least P steps back (Scheduler.stride).
    """

    def __init__(self, parallel: ParallelGroup, last_sampled: torch.Tensor, max_rows: int):
        self.parallel, self.last_sampled = parallel, last_sampled
        self.is_cuda = last_sampled.is_cuda
        self.pending: collections.deque = collections.deque()  # (step id, event or receive)
        if self.is_cuda:
            self.stream, self.send_stream = torch.cuda.Stream(), torch.cuda.Stream()
            self.buf = torch.empty(max_rows, dtype=torch.int32, device=last_sampled.device)

    def send(self, sampled: torch.Tensor) -> None:
        """Last stage: this step's sampled ids, one per sampling row."""
        ids = sampled.to(torch.int32).contiguous()
        if not self.is_cuda:
            self.parallel.send_to_first(ids)
            return
        self.send_stream.wait_stream(torch.cuda.current_stream())
        ids.record_stream(self.send_stream)
        with torch.cuda.stream(self.send_stream):
            self.parallel.send_to_first(ids)

    def post(self, step_id: int, rows: torch.Tensor) -> None:
        """First stage: receive step_id's ids for `rows` (its sampling rows, on the device)."""
        if not self.is_cuda:
            buf = torch.empty(rows.shape[0], dtype=torch.int32)
            self.pending.append((step_id, (self.parallel.irecv_from_last(buf), buf, rows)))
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # rows are on the device
        rows.record_stream(self.stream)  # freed by the step long before the ids arrive
        with torch.cuda.stream(self.stream):
            buf = self.buf[:rows.shape[0]]
            self.parallel.irecv_from_last(buf).wait()
            self.last_sampled[rows] = buf
            done = torch.cuda.Event()
            done.record()
        self.pending.append((step_id, done))

    def wait_through(self, step_id: int) -> None:
        """First stage: `last_sampled` holds the ids of every step up to step_id (on GPU:
        for the work enqueued next on the current stream)."""
        latest = None
        while self.pending and self.pending[0][0] <= step_id:
            _, latest = self.pending.popleft()
            if not self.is_cuda:
                work, buf, rows = latest
                work.wait()
                self.last_sampled[rows] = buf
        if self.is_cuda and latest is not None:
            torch.cuda.current_stream().wait_event(latest)
