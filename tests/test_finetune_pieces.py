"""A micro-batch run in pieces (engine_actors/finetune_pieces.py), as the worker runs it
between inference steps: its LoRA gradients equal transformers + peft's on the same batch
(fp32), and its optimizer step that of the whole micro-batch."""
from __future__ import annotations

import pytest
import torch

from engine_actors.finetune import Trainer
from engine_actors.finetune_pieces import Pieces
from tests.engine_harness import InProcessEngine
from tests.test_finetune import MASKS, SEQS, TARGETS, base, peft_backward, peft_params  # noqa: F401


def run_all(pieces: Pieces) -> int:
    n = 0
    while True:
        n += 1
        if pieces.run_next():
            return n


@pytest.mark.parametrize("per_segment,device", [
    (1, "cpu"), (2, "cpu"), pytest.param(1, "cuda", marks=pytest.mark.gpu)])
def test_pieces_gradients_equal_transformers_peft(base, per_segment, device):
    """One layer a segment (seven pieces for four layers), or two: peft's gradients."""
    ref = peft_backward(base, 4, 8, TARGETS)
    engine = InProcessEngine(device, model=base, dtype="float32", max_num_tokens=4096)
    trainer = Trainer(engine.worker.runner.model, 4, 8, TARGETS, lr=1e-3)
    params = peft_params(ref)
    with torch.no_grad():
        for (layer, target), (a, b) in trainer.params.items():
            a.copy_(params[layer, target, "A"])
            b.copy_(params[layer, target, "B"])
    layers = engine.worker.runner.model.layers
    flops = 4 * sum(p.numel() for p in layers["0"].parameters()) * 14  # a layer's backward
    pieces = Pieces(trainer, SEQS, MASKS, 7, last=False, piece_flops=per_segment * flops)
    segments = len(pieces.segments)
    assert segments == len(layers) // per_segment
    assert run_all(pieces) == -(-segments // 2) + 1 + segments
    assert pieces.loss_tokens == 7 and pieces.tokens == 14
    for (layer, target), (a, b) in trainer.params.items():
        for kind, ours in (("A", a), ("B", b)):
            theirs = params[layer, target, kind].grad
            assert theirs.abs().max() > 0, (layer, target, kind)
            error = (ours.grad.cpu() - theirs).norm() / theirs.norm()
            assert error < 1e-5, (layer, target, kind, float(error))


def test_pieces_step_the_optimizer_as_a_whole_micro_batch(base):
    """Two micro-batches of a batch, the second its last: the LoRA weights after the
    optimizer's step are those of the same two run whole, and the loss is the same."""
    engine = InProcessEngine("cpu", model=base, dtype="float32")
    model = engine.worker.runner.model
    trained = []
    for whole in (True, False):
        trainer = Trainer(model, 4, 8, ["q_proj", "down_proj"], lr=1e-2, seed=5)
        with torch.no_grad():
            for _, b in trainer.params.values():
                b.normal_(generator=torch.Generator().manual_seed(1))  # A gets gradients too
        losses = []
        for last in (False, True):
            if whole:
                losses.append(trainer.micro_step(SEQS, MASKS, 14, last)["loss_sum"])
            else:
                pieces = Pieces(trainer, SEQS, MASKS, 14, last, piece_flops=1)
                run_all(pieces)
                losses.append(float(pieces.loss_sum))
        trained.append((losses, [p.detach().clone() for ab in trainer.params.values()
                                 for p in ab]))
    (losses, whole), (piece_losses, pieces) = trained
    assert piece_losses == pytest.approx(losses, rel=1e-6)
    start = Trainer(model, 4, 8, ["q_proj", "down_proj"], lr=1e-2, seed=5)
    assert any(not torch.equal(p, q.detach()) for p, q in  # the step moved them
               zip(whole, [p for ab in start.params.values() for p in ab]))
    for p, q in zip(whole, pieces):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_worker_runs_a_micro_batch_in_pieces_and_times_each(base, device):
    """The worker's side: pieces launched one call at a time, each answered with its
    device time once it has run; the last with the loss, as the whole micro-batch's."""
    import asyncio
    engine = InProcessEngine(device, model=base, max_num_tokens=4096,
                             dtype="bfloat16" if device == "cuda" else "float32")
    worker = engine.worker
    worker._finetune("start", "job", 4, 8, TARGETS, 1e-3, 0)
    whole = Trainer(worker.runner.model, 4, 8, TARGETS, lr=1e-3)  # the same start
    expected = whole.micro_step(SEQS, MASKS, 7, last=False)["loss_sum"]
    answers, args = [], (0, SEQS, MASKS, 7, False)  # no KV blocks lent

    def run(number, count, *args):
        out, events = worker._finetune("piece", "job", number, count, *args)
        answers.append(asyncio.run(worker._piece_done(out, events)))

    run(1, 1, *args)  # one piece a call, as beside requests
    assert answers[0]["left"] >= 2  # forward, head, backward at least
    asyncio.run(worker.stop_training(2))  # a request came as run 2 was sent: it runs none
    run(2, 1 << 30)
    run(3, 1 << 30)  # the rest, in one call
    assert [a["ran"] for a in answers] == [1, 0, answers[0]["left"]]
    assert [a["done"] for a in answers] == [False, False, True] and answers[-1]["left"] == 0
    assert all(a["gpu_s"] > 0 for a in answers if a["ran"])
    assert answers[-1]["loss_sum"] == pytest.approx(expected, rel=1e-2 if device == "cuda"
                                                    else 1e-6)
    assert answers[-1]["tokens"] == 14 and answers[-1]["loss_tokens"] == 7
    assert worker.pieces is None  # its activations freed


@pytest.mark.gpu
def test_the_host_launches_at_most_two_pieces_ahead_of_the_device(base):
    """Behind a long kernel, the host launches two pieces and then waits until the first
    has run before it launches a third: a request that stops a run waits for two pieces,
    not for however many the host got ahead."""
    import time
    engine = InProcessEngine("cuda", model=base, dtype="float32", max_num_tokens=4096)
    trainer = Trainer(engine.worker.runner.model, 4, 8, TARGETS, lr=1e-3)
    run_all(Pieces(trainer, SEQS, MASKS, 7, last=False, piece_flops=1))  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10 ** 8)
    end.record()
    end.synchronize()
    cycles = int(10 ** 8 * 0.3 / (start.elapsed_time(end) / 1e3))  # ~0.3 s of device time
    pieces = Pieces(trainer, SEQS, MASKS, 7, last=False, piece_flops=1)
    assert pieces.num_pieces >= 4
    torch.cuda.synchronize()
    began = time.perf_counter()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    pieces.run_next()
    pieces.run_next()
    two = time.perf_counter() - began
    pieces.run_next()  # waits for the first, behind the long kernel
    three = time.perf_counter() - began
    end.synchronize()
    slept = start.elapsed_time(end) / 1e3  # (the clock may have changed since)
    assert slept > 0.05 and two < 0.5 * slept and three > 0.9 * slept, (two, three, slept)
    run_all(pieces)


@pytest.mark.gpu
def test_a_stop_heard_while_the_host_waits_for_the_device_launches_no_more_pieces(
        base, monkeypatch):
    """Behind a long kernel, the worker's run of pieces launches two and waits for the
    first; a request's stop that comes meanwhile ends the run there, with no third piece
    queued behind the two for the request's step to wait for."""
    import asyncio
    import functools
    import threading
    import time
    monkeypatch.setattr("engine_actors.worker.Pieces", functools.partial(Pieces, piece_flops=1))
    engine = InProcessEngine("cuda", model=base, dtype="float32", max_num_tokens=4096)
    worker = engine.worker
    worker._finetune("start", "job", 4, 8, TARGETS, 1e-3, 0)
    out, events = worker._finetune("piece", "job", 1, 1, 0, SEQS, MASKS, 7, False)
    assert out["left"] >= 4, out  # one piece run; enough left that the run cannot end
    torch.cuda.synchronize()
    torch.cuda._sleep(10 ** 9)  # ~0.5-1 s of device time ahead of the next pieces
    done = []
    thread = threading.Thread(target=lambda: done.append(
        worker._finetune("piece", "job", 2, 1 << 30)))
    thread.start()
    time.sleep(0.2)  # two pieces launched; the host waits for the first
    asyncio.run(worker.stop_training(2))
    thread.join()
    assert done[0][0]["ran"] == 2 and not done[0][0]["done"], done[0][0]
    worker._finetune("call_off", "job")
