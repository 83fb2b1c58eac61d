"""A fine-tuning micro-batch run in pieces, between inference steps (finetune_busy.py says
when; the worker runs them).

Run whole, a micro-batch of llama-8b holds the GPU for hundreds of milliseconds, and every
running request waits that long. In pieces of a few layers each, a request waits a few
milliseconds at a time. The layers are cut into segments whose inputs are detached leaves,
so each segment's backward pass runs on its own. The pieces, in order:
- the forward pass, two segments a piece;
- the head (final norm, logits, loss), which starts the backward pass;
- each segment's backward pass, last to first; the first segment's also hands the LoRA
  weights' gradients to the fp32 masters, and steps the optimizer after a batch's last
  micro-batch.
The activations stay on the device between pieces. The gradients are those of
`Trainer.micro_step` (tests/test_finetune_pieces.py checks).

The host launches a piece only once the one two before it has run on the device, so at
most two are queued there. A request that stops a run of pieces waits for those two, not
for however many the host got ahead (micro-batches of 4,096 tokens are device-bound: runs
took a median 22 ms, up to 69 ms, to stop; BENCHMARKS.md, 2026-11-27). The worker asks
whether to stop after that wait, just before each launch (`wait_queued`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# a backward piece's matmul work (two forward layers' worth per layer), about 3 ms on an H200
PIECE_FLOPS = 2e12
QUEUED = 2  # pieces launched and possibly not yet run on the device, at most


class Pieces:
    def __init__(self, trainer, sequences: list[list[int]], masks: list[list[bool]],
                 batch_loss_tokens: int, last: bool, piece_flops: float = PIECE_FLOPS):
        self.trainer, self.batch_loss_tokens, self.last = trainer, batch_loss_tokens, last
        self.ids, self.positions, self.cu, self.lens, self.trained = \
            trainer.inputs(sequences, masks)
        self.tokens = sum(self.lens)
        layers = list(trainer.model.layers.items())
        params = sum(p.numel() for p in layers[0][1].parameters())
        # a layer's backward: ~4 flops per weight and token (twice the forward's 2)
        size = max(1, int(piece_flops // (4 * params * self.tokens)))
        self.segments = [layers[i:i + size] for i in range(0, len(layers), size)]
        n = len(self.segments)
        # each segment's LoRA weights: its keys, and their ranges in cast_lora's A and B
        self.keys: list[list] = []
        self.ranges: list[tuple[slice, slice]] = []
        a_at = b_at = 0
        for segment in self.segments:
            ids = {layer_id for layer_id, _ in segment}
            keys = [k for k in trainer.params if k[0] in ids]
            a_n = sum(trainer.params[k][0].numel() for k in keys)
            b_n = sum(trainer.params[k][1].numel() for k in keys)
            self.keys.append(keys)
            self.ranges.append((slice(a_at, a_at + a_n), slice(b_at, b_at + b_n)))
            a_at, b_at = a_at + a_n, b_at + b_n
        self.todo = [("forward", s) for s in range(0, n, 2)] + [("head", n)] \
            + [("backward", s) for s in reversed(range(n))]
        self.tables: dict = {}
        self.inputs: list = [None] * n  # each segment's (hidden, residual) leaves
        self.outputs: list = [None] * n
        self.grads = None  # of the outputs of the segment whose backward is next
        self.casts = None  # the LoRA weights in the model's dtype (flat A and B)
        self.leaves: list = [None] * n  # each segment's slices of them, detached
        self.loss_sum = self.loss_tokens = None
        self.launched: list = []  # CUDA events after the latest pieces launched

    @property
    def num_pieces(self) -> int:
        """Pieces not launched yet."""
        return len(self.todo)

    def wait_queued(self) -> None:
        """Until fewer than QUEUED launched pieces may not have run (the wait lets go of the
        GIL). A stop is best asked after it: one heard meanwhile launches nothing more."""
        while len(self.launched) >= QUEUED:
            self.launched.pop(0).synchronize()

    def run_next(self) -> bool:
        """Launch the next piece; True once the last one is launched."""
        self.wait_queued()
        kind, s = self.todo.pop(0)
        with torch.enable_grad():
            if kind == "forward":
                for seg in (s, s + 1)[:len(self.segments) - s]:
                    self._forward(seg)
            elif kind == "head":
                self._head()
            else:
                self._backward(s)
        if self.ids.is_cuda:
            self.launched.append(torch.cuda.Event())
            self.launched[-1].record()
        return not self.todo

    def _forward(self, s: int) -> None:
        t = self.trainer
        if s == 0:
            hidden, residual = t.model.embed_tokens(self.ids), None
            self.casts = t.cast_lora(hidden.dtype)
        else:
            hidden, residual = self.inputs[s] = tuple(
                x.detach().requires_grad_() for x in self.outputs[s - 1])
        self.leaves[s] = [c[r].detach().requires_grad_() for c, r in zip(self.casts,
                                                                         self.ranges[s])]
        t._low = t.lora_views(*self.leaves[s], self.keys[s])
        for layer_id, layer in self.segments[s]:
            hidden, residual = t.layer_forward(layer_id, layer, hidden, residual, self.tables,
                                               self.positions, self.lens, self.cu)
        t._low = None
        self.outputs[s] = (hidden, residual)

    def _head(self) -> None:
        hidden, residual = (x.detach().requires_grad_() for x in self.outputs[-1])
        logits, targets = self.trainer.head(hidden, residual, self.ids, self.trained)
        loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        (loss_sum / self.batch_loss_tokens).backward()
        self.grads = (hidden.grad, residual.grad)
        self.loss_sum, self.loss_tokens = loss_sum.detach(), int(targets.numel())

    def _backward(self, s: int) -> None:
        pairs = [(o, g) for o, g in zip(self.outputs[s], self.grads) if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.outputs[s] = None
        if s:
            self.grads = tuple(x.grad for x in self.inputs[s])
            self.inputs[s] = None
            return
        grads = [torch.cat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                            for leaf in (pair[i] for pair in self.leaves)]) for i in (0, 1)]
        torch.autograd.backward(list(self.casts), grads)
        self.casts = self.grads = None
        self.leaves = [None] * len(self.segments)
        t = self.trainer
        if self.last:
            t.sum_gradients()
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=False)  # kept: see Trainer._create_state
