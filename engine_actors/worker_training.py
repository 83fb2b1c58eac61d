"""The worker's fine-tuning calls (a mixin of worker.py's Worker): a job's start, its
micro-batches (whole, or in pieces between inference steps: finetune_pieces.py), saving and
dropping it, and the KV memory lent to it (kv_memory.py). Every call runs on the worker's
launch thread, in one order with the inference steps on every rank (their collectives must
match); the tensor-parallel ranks agree on each call-off and failure before acting on it.
"""
from __future__ import annotations

import asyncio
import time

import torch

from engine_actors.finetune import Trainer
from engine_actors.finetune_memory import training_memory
from engine_actors.finetune_pieces import Pieces


class TrainingCalls:
    """Worker's fine-tuning state and calls (self.runner, self.device, self._launcher,
    self._turn and self._next_step are the Worker's)."""

    def init_training(self) -> None:
        self.trainers: dict[str, Trainer] = {}  # fine-tuning jobs' LoRA training state
        self._skip: set[int] = set()  # micro-batches called off (skip_training)
        self._train_seen = -1  # the latest micro-batch handed to the launch thread
        self._train_turn = asyncio.Condition()  # bound to the actor's loop at first use
        self._held = 0  # bytes the caching allocator holds and cannot give back (CUDA)
        self.pieces: tuple[str, Pieces] | None = None  # (job, micro-batch) run in pieces
        self._piece_base = 0  # memory allocated before it
        self._stop = 0  # runs of pieces numbered up to this stop after their current piece

    async def finetune(self, method: str, job_id: str, *args, turn: int | None = None):
        """A fine-tuning job's `start`, `micro_step`, `piece`, `save` or `drop` (engine_actors/
        finetune.py), on the launch thread. `turn`: the call's place among the steps (the
        executor numbers both), so that every rank runs steps and training in one order
        (their collectives must match). Without it (tests in-process), a micro-batch sent
        ahead names the one it follows (`after`), and goes to the thread only after it: an
        async actor may start calls out of their order."""
        loop = asyncio.get_running_loop()
        if turn is not None:
            if self._turn is None:
                self._turn = asyncio.Condition()
            async with self._turn:
                await self._turn.wait_for(lambda: self._next_step == turn)
                launch = loop.run_in_executor(self._launcher, self._finetune, method, job_id,
                                              *args)
                self._next_step += 1
                self._turn.notify_all()
            out = await launch
            return await self._piece_done(*out) if method == "piece" else out
        if method != "micro_step":
            return await loop.run_in_executor(self._launcher, self._finetune, method, job_id,
                                              *args)
        seq, after = args[0], args[1]
        async with self._train_turn:
            await self._train_turn.wait_for(lambda: after < 0 or self._train_seen >= after)
            self._train_seen = max(self._train_seen, seq)
            launch = loop.run_in_executor(self._launcher, self._finetune, method, job_id, *args)
            self._train_turn.notify_all()
        return await launch

    def _finetune(self, method: str, job_id: str, *args):
        if method == "start":
            self.trainers[job_id] = Trainer(self.runner.model, *args)
            if self.device == "cuda":  # what the allocator holds and cannot give back
                torch.cuda.empty_cache()  # (the graphs' pools): not free for training
                self._held = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            return self._training_memory()
        if method == "micro_step":  # args: its number, the one it follows (-1: none), the
            if self._lend(args[2], args[0]):  # KV units to lend, the batch
                return {"skipped": True, **self._training_memory()}
            out = self.trainers[job_id].micro_step(*args[3:])
            return {**out, **self._training_memory()}
        if method == "piece":
            return self._piece(job_id, *args)
        if method == "call_off":  # the micro-batch in pieces: its activations freed
            self.pieces = None
            return None
        if method == "take_back":  # the lent KV blocks, mapped again before inference
            self.runner.kv_memory.take_back()
        elif method == "drop":
            self.trainers.pop(job_id, None)
            if self.pieces is not None and self.pieces[0] == job_id:
                self.pieces = None
            if self.device == "cuda":
                torch.cuda.empty_cache()
        elif method == "resident":  # job id -> bytes of its parameters and optimizer state
            return {j: t.state_bytes() for j, t in self.trainers.items()}
        else:
            return getattr(self.trainers[job_id], method)(*args)

    def _piece(self, job_id: str, run: int, count: int, *batch):
        """Launch up to `count` pieces of a micro-batch in pieces (finetune_pieces.py), back
        to back, fewer when it ends or run `run` is told to stop (`stop_training`: a request
        came). `batch` (KV units lent to it, sequences, masks, the batch's trained tokens,
        whether it is the batch's last) starts a new one. Returns what `_piece_done`
        completes, and the CUDA events around the pieces (None on CPU)."""
        cuda = self.device == "cuda"
        if batch:
            self._lend(batch[0])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                self._piece_base = torch.cuda.memory_allocated()
            self.pieces = (job_id, Pieces(self.trainers[job_id], *batch[1:]))
        pieces = self.pieces[1]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        start = time.perf_counter()
        if cuda:
            events[0].record()
        ran, done = 0, False
        try:  # (a run may stop before its first piece: a request came as it was sent)
            while not done and ran < count and not (pieces.wait_queued() or count > 1
                                                    and self._stopping(run)):
                done = pieces.run_next()
                ran += 1
        except Exception:
            self.pieces = None  # its activations freed
            raise
        out = {"done": done, "left": pieces.num_pieces, "ran": ran, "host_s": 0.0}
        if done:
            self.pieces = None
            out.update(loss_sum=pieces.loss_sum.to("cpu", non_blocking=True),
                       loss_tokens=pieces.loss_tokens, tokens=pieces.tokens,
                       peak_bytes=torch.cuda.max_memory_allocated() - self._piece_base
                       if cuda else None, **self._training_memory())
        if cuda:
            events[1].record()
        out["host_s"] = time.perf_counter() - start
        return out, events

    def _lend(self, units: int, seq: int = -1) -> bool:
        """Free the memory of `units` KV units for training (kv_memory.py). The tensor-
        parallel ranks agree first whether any failed (raised then on all, so none is left
        alone in a later collective), and whether micro-batch `seq` was called off (True)."""
        try:
            self.runner.kv_memory.lend(units)
            error = None
        except Exception as e:
            error = e
        skip, failed = self._agree(seq, error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("lending KV memory to training failed on another "
                               "tensor-parallel rank")
        return skip

    def _stopping(self, run: int) -> bool:
        """Whether run `run` of pieces stops now, as the tensor-parallel ranks agree (each
        asks after the same pieces; one that heard of the stop decides for all)."""
        stop = self._stop >= run
        if self.runner.parallel.tp_size > 1:
            flag = torch.tensor([float(stop)], device=self.runner.model.embed_tokens.weight.device)
            stop = bool(self.runner.parallel.all_reduce(flag).item())
        return stop

    async def stop_training(self, run: int) -> None:
        """Runs of pieces numbered up to `run` stop after their current piece (a request
        came). On the actor's loop, so it lands while the launch thread trains."""
        self._stop = max(self._stop, run)

    async def _piece_done(self, out: dict, events) -> dict:
        """A run of pieces' answer once the device has run it: its device time (`gpu_s`;
        its host time on CPU) and, after the micro-batch's last piece, its loss."""
        out["gpu_s"] = out["host_s"]
        if events is not None:
            await asyncio.to_thread(events[1].synchronize)
            out["gpu_s"] = events[0].elapsed_time(events[1]) / 1e3
        if out["done"]:
            out["loss_sum"] = float(out["loss_sum"])
        return out

    async def skip_training(self, seq: int) -> None:
        """Micro-batch `seq` (sent ahead) is not to run if it has not started. On the
        actor's loop, so it lands while the launch thread trains."""
        self._skip.add(seq)

    def _agree(self, seq: int, failed: bool) -> tuple[bool, bool]:
        """(whether micro-batch `seq` was called off, whether its preparation failed) as
        the tensor-parallel ranks agree: any rank that heard of the call-off, or failed,
        decides for all, so they all run it or none does (a rank alone in a collective
        would wait forever)."""
        skip = seq in self._skip
        self._skip = {s for s in self._skip if s > seq}  # later ones only (seq grows)
        if self.runner.parallel.tp_size > 1:
            flags = torch.tensor([float(skip), float(failed)],
                                 device=self.runner.model.embed_tokens.weight.device)
            skip, failed = (bool(f) for f in self.runner.parallel.all_reduce(flags).tolist())
        return skip, failed

    def _training_memory(self) -> dict:
        return training_memory(self.runner, self.device, self._held)
