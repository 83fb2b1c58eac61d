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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# a backward piece's matmul work (two forward layers' worth per layer), about 3 ms on an H200
PIECE_FLOPS = 2e12


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
        self.todo = [("forward", s) for s in range(0, n, 2)] + [("head", n)] \
            + [("backward", s) for s in reversed(range(n))]
        self.tables: dict = {}
        self.inputs: list = [None] * n  # each segment's (hidden, residual) leaves
        self.outputs: list = [None] * n
        self.grads = None  # of the outputs of the segment whose backward is next
        self.casts = self.leaves = None  # the LoRA weights in the model's dtype
        self.loss_sum = self.loss_tokens = None

    @property
    def num_pieces(self) -> int:
        return len(self.todo)

    def run_next(self) -> bool:
        """Launch the next piece; True once the last one is launched."""
        kind, s = self.todo.pop(0)
        with torch.enable_grad():
            if kind == "forward":
                for seg in (s, s + 1)[:len(self.segments) - s]:
                    self._forward(seg)
            elif kind == "head":
                self._head()
            else:
                self._backward(s)
        return not self.todo

    def _forward(self, s: int) -> None:
        t = self.trainer
        if s == 0:
            hidden, residual = t.model.embed_tokens(self.ids), None
            self.casts = t.cast_lora(hidden.dtype)
            self.leaves = [c.detach().requires_grad_() for c in self.casts]
        else:
            hidden, residual = self.inputs[s] = tuple(
                x.detach().requires_grad_() for x in self.outputs[s - 1])
        t._low = t.lora_views(*self.leaves)  # views of its own: each segment's graph apart
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
        cast = [(c, leaf.grad) for c, leaf in zip(self.casts, self.leaves) if leaf.grad is not None]
        torch.autograd.backward([c for c, _ in cast], [g for _, g in cast])
        self.casts = self.leaves = self.grads = None
        t = self.trainer
        if self.last:
            t.sum_gradients()
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=False)  # kept: see Trainer._create_state
