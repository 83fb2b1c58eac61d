"""Fine-tuning on the worker: one training step's LoRA gradients equal transformers + peft's
on the same batch (fp32), the saved adapter is PEFT's, the training file's masks, and the
worker's side of micro-batches sent ahead. The scheduler's side, without a model:
test_finetune_scheduling.py."""
from __future__ import annotations

import json

import pytest
import torch

from engine_actors.checkpoint import save_random_llama
from engine_actors.finetune import Trainer
from tests.engine_harness import InProcessEngine

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ft") / "base")
    save_random_llama(path, seed=9)
    return path


def peft_model(base: str, rank: int, alpha: int, targets: list[str]):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          init_lora_weights=False)  # B random too: A gets gradients
    return peft.get_peft_model(model, cfg)


def peft_params(model) -> dict[tuple[str, str, str], torch.nn.Parameter]:
    """(layer, target, "A"/"B") -> peft's parameter."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            parts = name.split(".")
            layer = parts[parts.index("layers") + 1]
            kind = "A" if "lora_A" in name else "B"
            target = parts[parts.index(f"lora_{kind}") - 1]
            out[layer, target, kind] = p
    return out


# two ragged examples; the loss is on the completion tokens only
SEQS = [[5, 17, 99, 3, 250, 41, 7, 7, 80], [12, 200, 13, 64, 9]]
MASKS = [[False] * 5 + [True] * 4, [False] * 2 + [True] * 3]


def peft_backward(base: str, rank: int, alpha: int, targets: list[str]):
    """peft's model after one backward pass over SEQS (its LoRA gradients set)."""
    ref = peft_model(base, rank, alpha, targets)
    width = max(map(len, SEQS))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in SEQS])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in SEQS])
    labels = torch.tensor([[t if m else -100 for t, m in zip(s, mask)] + [-100] * (width - len(s))
                           for s, mask in zip(SEQS, MASKS)])
    ref(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
    return ref


@pytest.mark.parametrize("targets,device", [
    (TARGETS, "cpu"), (["q_proj", "v_proj", "down_proj"], "cpu"),
    pytest.param(TARGETS, "cuda", marks=pytest.mark.gpu)])
def test_one_step_gradients_equal_transformers_peft(base, targets, device):
    rank, alpha = 4, 8
    ref = peft_backward(base, rank, alpha, targets)
    seqs, masks = SEQS, MASKS
    engine = InProcessEngine(device, model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, rank, alpha, targets, lr=1e-3)
    params = peft_params(ref)
    with torch.no_grad():
        for (layer, target), (a, b) in trainer.params.items():
            a.copy_(params[layer, target, "A"])
            b.copy_(params[layer, target, "B"])
    out = trainer.micro_step(seqs, masks, batch_loss_tokens=7, last=False)
    assert out["loss_tokens"] == 7 and out["tokens"] == 14
    for (layer, target), (a, b) in trainer.params.items():
        for kind, ours in (("A", a), ("B", b)):
            theirs = params[layer, target, kind].grad
            assert theirs.abs().max() > 0, (layer, target, kind)  # the test can fail
            # relative to the gradient's norm: fp32 sums in another order differ by ~1e-7
            error = (ours.grad.cpu() - theirs).norm() / theirs.norm()
            assert error < 1e-5, (layer, target, kind, float(error))


def _tp_rank(rank: int, base: str, address: str, targets: list[str], ref_path: str,
             out_path: str) -> None:
    """Both ways of running the micro-batch, whole then in pieces, in one gloo group (one
    process start for both): `out_path` + ".whole" / ".pieces"."""
    from engine_actors.parallel import init_parallel
    parallel = init_parallel(address, rank, 2, 1, "cpu", 60)
    for pieces in (False, True):
        _tp_rank_once(rank, parallel, base, targets, ref_path,
                      out_path + (".pieces" if pieces else ".whole"), pieces)
    # both ranks done before either tears gloo down: a rank that exited while the other
    # still had its group open once aborted ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _tp_rank_once(rank: int, parallel, base: str, targets: list[str], ref_path: str,
                  out_path: str, pieces: bool) -> None:
    """One of two tensor-parallel ranks (gloo): set the reference's LoRA weights, shard by
    shard, run one micro-batch (whole, or in pieces of a layer), sum the whole tensors'
    gradients, gather the shards."""
    from engine_actors.layers.lora import MODULES
    from engine_actors.model_runner import ModelRunner
    model = ModelRunner(base, "cpu", torch.float32, 64, 16, 4, 0, parallel=parallel).model
    trainer = Trainer(model, 4, 8, targets, lr=1e-3)
    ref = torch.load(ref_path)
    modules = {(layer, target): (model.layers[layer].get_submodule(MODULES[target][0]),
                                 MODULES[target][1]) for layer, target in trainer.params}
    with torch.no_grad():
        for key, (a, b) in trainer.params.items():
            module, part = modules[key]
            full_a, full_b = ref[key + ("A",)], ref[key + ("B",)]
            if hasattr(module, "local_columns"):  # row-parallel: A's input columns
                a.copy_(module.local_columns(full_a))
                b.copy_(full_b)
            else:  # column-parallel: B's output rows of this rank's heads
                a.copy_(full_a)
                b.copy_(module.local_rows(full_b, part)[1])
    if pieces:
        from engine_actors.finetune_pieces import Pieces
        micro = Pieces(trainer, SEQS, MASKS, 7, last=False, piece_flops=1)
        while not micro.run_next():
            pass
        out = {"loss_sum": float(micro.loss_sum)}
    else:
        out = trainer.micro_step(SEQS, MASKS, batch_loss_tokens=7, last=False)
    trainer.sum_gradients()
    grads = {}
    for key, (a, b) in trainer.params.items():
        module, _ = modules[key]
        if hasattr(module, "local_columns"):
            grads[key] = (parallel.all_gather_last_dim(a.grad), b.grad)
        else:
            grads[key] = (a.grad, parallel.all_gather_last_dim(b.grad.T.contiguous()).T)
    trainer.save(out_path + ".adapter", base)  # collective: the shards are gathered
    if rank == 0:
        torch.save({"grads": grads, "loss_sum": out["loss_sum"]}, out_path)


def test_tensor_parallel_gradients_equal_transformers_peft(base, tmp_path):
    """T=2 (gloo): each rank trains its shards of the adapter; gathered, the gradients of
    one step (whole, or in pieces: finetune_pieces.py) equal transformers + peft's on the
    same batch, and the saved adapter holds the whole weights."""
    import torch.multiprocessing as mp

    from engine_actors.parallel import free_address
    targets = TARGETS
    params = peft_params(peft_backward(base, 4, 8, targets))
    torch.save({k: p.detach() for k, p in params.items()}, tmp_path / "ref.pt")
    mp.spawn(_tp_rank, args=(base, free_address(), targets, str(tmp_path / "ref.pt"),
                             str(tmp_path / "out.pt")), nprocs=2)
    for way in ("whole", "pieces"):
        check_tp_outputs(params, str(tmp_path / f"out.pt.{way}"))


def check_tp_outputs(params, out_path: str) -> None:
    grads = torch.load(out_path)["grads"]
    from safetensors.torch import load_file
    saved = load_file(out_path + ".adapter/adapter_model.safetensors")
    for (layer, target, kind), p in params.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{kind}.weight"
        torch.testing.assert_close(saved[name], p.detach())  # no step ran: the set weights
    for (layer, target), (grad_a, grad_b) in grads.items():
        for kind, ours in (("A", grad_a), ("B", grad_b)):
            theirs = params[layer, target, kind].grad
            assert theirs.abs().max() > 0, (layer, target, kind)
            error = (ours - theirs).norm() / theirs.norm()
            assert error < 1e-5, (layer, target, kind, float(error))


def test_saved_adapter_is_peft_format(base, tmp_path):
    """A trained adapter loads in peft and gives what our trainer's forward gives."""
    engine = InProcessEngine(model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, 4, 16, ["q_proj", "up_proj"], lr=1e-2)
    seq, mask = [7, 8, 9, 10, 11, 12], [False, False, True, True, True, True]
    for _ in range(3):
        trainer.micro_step([seq], [mask], 4, last=True)
    trainer.save(str(tmp_path / "adapter"), base)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16
    from transformers import AutoModelForCausalLM
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([seq])).logits[0, 1:-1]
        ours, _ = trainer.forward([seq], [mask])
    assert trainer.params["0", "q_proj"][1].abs().max() > 0  # training moved B off zero
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_training_file_masks_completions_and_assistant_turns():
    from deployments.protocol import APIError
    from deployments.training_data import parse_training_file
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path("tiny-random-llama"))
    lines = [json.dumps({"prompt": "ab", "completion": "cd"}),
             json.dumps({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "yo"},
                                      {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "ok"}]})]
    (ids, mask), (chat_ids, chat_mask) = parse_training_file("\n".join(lines).encode(), tok, 512)
    prompt = tok.encode("ab", add_special_tokens=True)
    assert ids == prompt + tok.encode("cd", add_special_tokens=False) + [tok.eos_token_id]
    assert mask == [False] * len(prompt) + [True] * 3
    trained = tok.decode([t for t, m in zip(chat_ids, chat_mask) if m])
    assert "yo" in trained and "ok" in trained and "hi" not in trained and "again" not in trained
    # nothing predicts a sequence's first token: an empty prompt leaves it untrained
    (ids, mask), = parse_training_file(json.dumps({"prompt": "", "completion": "cd"}).encode(),
                                       tok, 512)
    assert ids[-3:] == tok.encode("cd", add_special_tokens=False) + [tok.eos_token_id]
    assert not mask[0] and mask[-2:] == [True, True]

    class NoEos:  # a tokenizer without BOS or EOS: a one-token completion alone is untrainable
        eos_token_id = None

        def encode(self, text, add_special_tokens):
            return list(text.encode())

    with pytest.raises(APIError, match="line 1: no token to train on"):
        parse_training_file(json.dumps({"prompt": "", "completion": "c"}).encode(), NoEos(), 512)
    # OpenAI's weight 0: that assistant message is context, not trained on
    weighted = json.loads(lines[1])
    weighted["messages"][1]["weight"] = 0
    (w_ids, w_mask), = parse_training_file(json.dumps(weighted).encode(), tok, 512)
    assert w_ids == chat_ids
    trained = tok.decode([t for t, m in zip(w_ids, w_mask) if m])
    assert "ok" in trained and "yo" not in trained
    weighted["messages"][0]["weight"] = 1  # a user message takes no weight
    with pytest.raises(APIError, match="line 1: messages.0..weight"):
        parse_training_file(json.dumps(weighted).encode(), tok, 512)
    with pytest.raises(APIError, match="line 2: not valid JSON"):
        parse_training_file(b'{"prompt": "a", "completion": "b"}\n{oops', tok, 512)
    with pytest.raises(APIError, match="line 1: .* over the limit of 4"):
        parse_training_file(json.dumps({"prompt": "abcdef", "completion": "g"}).encode(), tok, 4)


def test_training_lines_with_tools_and_tool_calls_render_as_the_chat_route_does():
    """OpenAI's format for training tool use: the line's tools, an assistant message whose
    tool_calls stand for its content, the tool's answer. The tools are in the untrained
    prompt, the call (arguments as the template writes an object) is trained on."""
    from deployments.protocol import APIError
    from deployments.training_data import parse_training_file
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path("tiny-random-llama"))
    tool = {"type": "function", "function": {"name": "get_weather", "description": "w",
                                             "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    row = {"tools": [tool], "parallel_tool_calls": False, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is fine."}]}
    (ids, mask), = parse_training_file(json.dumps(row).encode(), tok, 2048)
    as_object = [dict(m, content=m["content"] or "") for m in row["messages"]]
    as_object[1]["tool_calls"] = [dict(call, function={"name": "get_weather",
                                                       "arguments": {"city": "Rome"}})]
    text = tok.apply_chat_template(as_object, tools=[tool], tokenize=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    untrained = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert '"name": "get_weather"' in trained and '{"city": "Rome"}' in trained
    assert "It is fine." in trained and "sunny" not in trained
    assert '"description": "w"' in untrained and "weather?" in untrained
    for bad, match in [
            ({**row, "tools": tool}, "line 1: tools must be a list"),
            ({**row, "tools": [{"type": "function"}]}, r"line 1: tools\[0\].function"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": [call]},
                           {"role": "assistant", "content": "y"}]},
             r"line 1: messages\[0\].tool_calls: only assistant"),
            ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
              "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
             r"line 1: messages\[1\].tool_calls.0.function.name")]:
        with pytest.raises(APIError, match=match):
            parse_training_file(json.dumps(bad).encode(), tok, 2048)


@pytest.mark.gpu
def test_varlen_attention_gives_the_per_sequence_gradients(base):
    """bf16 on CUDA: one variable-length flash call per layer trains as the call per
    sequence does (same loss and LoRA gradients, within bf16 rounding)."""
    from engine_actors.training_ops import varlen_attention
    if not torch.cuda.is_available() or varlen_attention() is None:
        pytest.skip("needs a GPU and torch.nn.attention.varlen")
    engine = InProcessEngine("cuda", model=base, dtype="bfloat16", max_num_tokens=4096)
    results = []
    for varlen in (False, True):
        trainer = Trainer(engine.worker.runner.model, 4, 8, TARGETS, lr=1e-3)
        torch.manual_seed(0)
        with torch.no_grad():
            for _, b in trainer.params.values():
                b.normal_()  # so that A gets gradients too
        trainer.varlen = varlen
        out = trainer.micro_step(SEQS, MASKS, 7, last=False)
        results.append((out["loss_sum"], [p.grad.clone() for ab in trainer.params.values()
                                          for p in ab]))
    (loss, grads), (varlen_loss, varlen_grads) = results
    assert varlen_loss == pytest.approx(loss, rel=1e-2)
    for g, h in zip(grads, varlen_grads):
        assert float((h - g).norm() / g.norm()) < 3e-2


def test_training_state_exists_before_a_step_and_steps_as_a_fresh_adamw(base):
    """A step allocates no lasting state (what the KV pool lent it is all free after), and
    the optimizer's first step equals that of an AdamW whose state starts with it."""
    engine = InProcessEngine("cpu", model=base, dtype="float32")
    trainer = Trainer(engine.worker.runner.model, 4, 8, ["q_proj", "down_proj"], lr=1e-2)
    held = trainer.state_bytes()
    params = [p for ab in trainer.params.values() for p in ab]
    with torch.no_grad():
        for p in params:
            p.normal_()  # B starts at zero: random, so both A and B get gradients
    trainer.micro_step(SEQS, MASKS, 7, last=False)
    assert trainer.state_bytes() == held
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.0)
    reference.step()
    trainer.optimizer.step()
    for c, p in zip(copies, params):
        torch.testing.assert_close(p.detach(), c.detach(), rtol=0, atol=0)
    trainer.micro_step(SEQS, MASKS, 7, last=True)
    assert trainer.state_bytes() == held


def test_a_bf16_model_trains_fp32_masters_that_keep_updates_below_bf16_resolution(base):
    """bf16 weights: the LoRA parameters and AdamW's moments are fp32, so a step far smaller
    than bf16's resolution (~0.4% of a value) still moves them."""
    engine = InProcessEngine("cpu", model=base, dtype="bfloat16")
    assert engine.worker.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    trainer = Trainer(engine.worker.runner.model, 4, 8, ["q_proj", "down_proj"], lr=1e-6)
    params = [p for ab in trainer.params.values() for p in ab]
    with torch.no_grad():
        for p in params:
            p.uniform_(0.5, 1.0)  # B starts at zero: both get gradients; values bf16 can hold
    before = [p.detach().clone() for p in params]
    trainer.micro_step(SEQS, MASKS, 7, last=False)
    # (such large LoRA weights saturate some attention: those parameters get gradients too
    # small for AdamW to move them past its eps)
    live = [i for i, p in enumerate(params) if p.grad.abs().max() > 1e-4]
    assert len(live) >= len(params) // 2
    trainer.micro_step(SEQS, MASKS, 7, last=True)
    assert all(p.dtype == torch.float32 for p in params)
    assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values()
               for k, v in s.items() if k != "step")
    moved = [float((params[i].detach() - before[i]).abs().max()) for i in live]
    # AdamW's first step moves each element by about lr: ~1e-6 on values of 0.5-1, which
    # bf16 (8 bits of mantissa) would round back to the value before
    assert all(0 < m < 2e-6 for m in moved), moved
