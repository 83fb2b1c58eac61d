"""An in-process engine (scheduler + a real worker, no Ray) and transformers references."""
from __future__ import annotations

import collections

import torch

from engine_actors.checkpoint import model_info
from engine_actors.config import EngineConfig
from engine_actors.lora import LoRARegistry
from engine_actors.request import Request
from engine_actors.scheduler import Scheduler
from engine_actors.worker import Worker


class InProcessEngine:
    """The scheduler actor's loop without Ray: up to max_steps_in_flight steps are launched
    before the oldest one's tokens are processed, as in the actor."""

    def __init__(self, device: str = "cpu", **args):
        self.cfg = EngineConfig.from_args(args)
        info = model_info(self.cfg)
        self.worker = Worker(self.cfg, device)
        self.worker.setup(info.max_model_len, config=info.config)  # as the executor sends it
        num_blocks = self.worker.num_kv_blocks()
        self.worker.init_kv_cache(num_blocks)
        self.scheduler = Scheduler.from_config(self.cfg, num_blocks, info.max_model_len,
                                               info.eos_token_ids)
        self.loras = LoRARegistry(self.cfg.max_lora_rank, (info.lora_shapes, info.num_layers))
        for name, path in self.cfg.lora_modules.items():
            self.loras.add(name, path)
        self.steps = []
        self.logprobs: dict[str, list] = {}  # request id -> per generated token, when asked
        self.prompt_logprobs: dict[str, list] = {}
        self.finish_reasons: dict[str, str] = {}
        self.embeddings: dict[str, bytes] = {}  # runner "pooling": float32

    def run(self, arrivals: dict[int, list[tuple]]):
        """arrivals: loop round -> requests (id, prompt, SamplingParams[, LoRA adapter name])
        added before it. Returns request id -> tokens."""
        outputs: dict[str, list[int]] = {}
        in_flight = collections.deque()
        it = 0
        while it <= max(arrivals) or self.scheduler.pool:
            for rid, prompt, sampling, *lora in arrivals.get(it, []):
                adapter = self.loras.adapters[lora[0]] if lora and lora[0] else None
                self.scheduler.add(Request(rid, prompt, sampling, float(it), lora=adapter))
                outputs[rid] = []
            it += 1
            while len(in_flight) < self.cfg.max_steps_in_flight:
                batch = self.scheduler.schedule()
                if batch is None:
                    break
                batch.step.step_id = len(self.steps)
                self.steps.append(batch.step)
                in_flight.append((batch, self.worker.runner.launch(batch.step)))
            if in_flight:
                batch, pending = in_flight.popleft()
                for out in self.scheduler.process(batch, pending.result()):
                    outputs[out.request_id].extend(out.new_token_ids)
                    self.logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
                    self.prompt_logprobs.setdefault(out.request_id, []).extend(
                        out.prompt_logprobs or [])
                    if out.finish_reason is not None:
                        self.finish_reasons[out.request_id] = out.finish_reason
                    if out.embedding is not None:
                        self.embeddings[out.request_id] = out.embedding
        return outputs


def hf_model(model_dir: str, device: str = "cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    key = (model_dir, device, dtype)
    if key not in _hf_cache:
        _hf_cache[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(
            device).eval()
    return _hf_cache[key]


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int,
              device: str = "cpu") -> list[int]:
    """transformers' generate(), greedy, fp32, one request at a time (no padding)."""
    model = hf_model(model_dir, device)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_hf_cache: dict = {}
