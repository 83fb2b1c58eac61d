"""An in-process engine (scheduler + a real worker, no Ray) and transformers references."""
from __future__ import annotations

import torch

from engine_actors.checkpoint import model_info
from engine_actors.config import EngineConfig
from engine_actors.kv_cache import KVCacheManager
from engine_actors.policies import Budget, make_policy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import Scheduler
from engine_actors.worker import Worker


class InProcessEngine:
    def __init__(self, **args):
        self.cfg = EngineConfig.from_args(args)
        info = model_info(self.cfg)
        max_num_seqs = self.cfg.max_batch_size
        self.worker = Worker(self.cfg, "cpu", info.max_model_len, max_num_seqs)
        num_blocks = self.worker.num_kv_blocks()
        self.worker.init_kv_cache(num_blocks)
        kv = KVCacheManager(num_blocks, self.cfg.block_size, max_num_seqs)
        budget = Budget(self.cfg.max_batch_size, self.cfg.max_num_batched_tokens)
        self.scheduler = Scheduler(kv, make_policy(self.cfg.scheduling_policy), budget,
                                   info.max_model_len, set(info.eos_token_ids))
        self.steps = []

    def run(self, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]):
        """arrivals: iteration -> requests added before it. Returns request id -> tokens."""
        outputs: dict[str, list[int]] = {}
        it = 0
        while it <= max(arrivals) or self.scheduler.pool:
            for rid, prompt, sampling in arrivals.get(it, []):
                self.scheduler.add(Request(rid, prompt, sampling, float(it)))
                outputs[rid] = []
            it += 1
            batch = self.scheduler.schedule()
            if batch is None:
                continue
            self.steps.append(batch.step)
            for out in self.scheduler.process(batch, self.worker.execute(batch.step)):
                outputs[out.request_id].extend(out.new_token_ids)
        return outputs


def hf_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(), greedy, fp32, one request at a time (no padding)."""
    from transformers import AutoModelForCausalLM
    model = _hf_cache.get(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _hf_cache[model_dir] = model
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_hf_cache: dict = {}
