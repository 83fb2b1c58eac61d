"""A worker's place in the P x T grid, and the collectives between workers.

Worker rank r is tensor-parallel rank r % T of pipeline stage r // T. Activations move only
here, over torch.distributed (NCCL on GPU, gloo on CPU): all-reduce / all-gather inside a
stage, send / recv of hidden states between neighbouring stages. Control messages never do.
"""
from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# All-reduces up to this size (a [512, 4096] bf16 decode step's) run in one kernel over peer
# memory; larger ones (prefill) go through NCCL. From load_tests/bench_allreduce.py.
ONE_SHOT_MAX_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None  # the stage's torch ProcessGroup when tp_size > 1
    one_shot: object = None  # kernels/all_reduce.OneShotAllReduce for small CUDA messages

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce_input(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where to write a tensor that all_reduce will sum, to save it a copy: the one-shot
        all-reduce's own buffer when the message fits, else None (any tensor will do)."""
        return None if self.one_shot is None else self.one_shot.input_buffer(shape, dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the stage's tensor-parallel ranks (in place, except for a tensor from
        all_reduce_input: use the returned one)."""
        if self.tp_size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., tp_size * n], ranks in order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one NCCL all-gather along dim 0, then the ranks' columns side by side
            out = torch.empty((self.tp_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.tp_group)
            return torch.cat(out.unbind(0), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def send_next(self, x: torch.Tensor) -> None:
        """To the same tensor-parallel rank of the next stage (x contiguous)."""
        dist.send(x, dst=self.rank + self.tp_size)

    def recv_prev(self, x: torch.Tensor) -> torch.Tensor:
        """Into x (contiguous), from the same tensor-parallel rank of the previous stage."""
        dist.recv(x, src=self.rank - self.tp_size)
        return x

    def send_to_first(self, x: torch.Tensor) -> None:
        """Last stage -> the same tensor-parallel rank of the first stage (sampled ids)."""
        dist.send(x, dst=self.tp_rank)

    def irecv_from_last(self, x: torch.Tensor):
        """First stage: receive into x from the last stage; returns the pending Work."""
        return dist.irecv(x, src=(self.pp_size - 1) * self.tp_size + self.tp_rank)


SINGLE = ParallelGroup()


def free_address() -> str:
    """host:port of a free port on this machine, for a process group's rendezvous."""
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket() as s:
        s.bind(("", 0))
        return f"{host}:{s.getsockname()[1]}"


def init_parallel(address: str, rank: int, tp_size: int, pp_size: int, device: str,
                  timeout_s: float, one_shot_bytes: int = 0) -> ParallelGroup:
    """Join the worker group's process group (collective: every worker calls it).
    one_shot_bytes > 0: on CUDA, all-reduces up to that size run through peer memory
    (kernels/all_reduce.py) instead of NCCL."""
    world = tp_size * pp_size
    if world == 1:
        return SINGLE
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} \
        if device == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            **kwargs)
    # every rank creates every stage's group, in the same order, members or not
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
              for s in range(pp_size)]
    pp_rank, tp_rank = rank // tp_size, rank % tp_size
    one_shot = None
    if tp_size > 1 and device == "cuda" and one_shot_bytes > 0:
        one_shot = _one_shot(groups[pp_rank], tp_rank, tp_size, one_shot_bytes)
    return ParallelGroup(tp_rank, tp_size, pp_rank, pp_size,
                         groups[pp_rank] if tp_size > 1 else None, one_shot)


def _one_shot(group, tp_rank: int, tp_size: int, max_bytes: int):
    """The stage's one-shot all-reduce, or None (NCCL for everything) unless every rank of
    the stage could map its peers' memory: the ranks must all take the same path."""
    from kernels.all_reduce import OneShotAllReduce
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        one_shot = OneShotAllReduce(group, tp_rank, tp_size, max_bytes, device)
    except (RuntimeError, ImportError, AttributeError, OSError) as e:  # no peer memory here
        logger.warning("one-shot all-reduce unavailable, using NCCL for all: %s", e)
        one_shot = None
    ok = torch.tensor([one_shot is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return one_shot if ok.item() else None


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The contiguous layers of a stage; sizes differ by at most one (earlier stages larger)."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank's equal share of `size` (which world must divide)."""
    if size % world:
        raise ValueError(f"{size} does not split evenly over {world} tensor-parallel ranks")
    length = size // world
    return rank * length, length
