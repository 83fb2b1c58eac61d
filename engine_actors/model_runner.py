"""One iteration on one device: step message -> flattened tensors -> model -> sampled ids."""
from __future__ import annotations

import numpy as np
import torch

from engine_actors.checkpoint import iter_checkpoint_tensors, load_hf_config
from engine_actors.kv_cache import cdiv
from engine_actors.layers.attention import AttentionMetadata
from engine_actors.messages import StepInput
from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.sampler import Sampler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return DTYPES[dtype]


class ModelRunner:
    def __init__(self, model_path: str, device: str, dtype: torch.dtype, max_model_len: int,
                 block_size: int, max_num_seqs: int, seed: int):
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.hf_config = load_hf_config(model_path)
        self.model = self._load_model(model_path)
        cfg = self.hf_config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # row r holds the block ids of the request admitted at row r, in position order
        self.block_table = torch.zeros(max_num_seqs, cdiv(max_model_len, block_size),
                                       dtype=torch.int32, device=self.device)
        self.sampler = Sampler(max_num_seqs, self.device, seed)

    def _load_model(self, path: str) -> LlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.hf_config, self.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        loaded = {model.load_weight(name, tensor.to(self.dtype))
                  for name, tensor in iter_checkpoint_tensors(path)}
        missing = model.weight_keys() - loaded
        if missing:
            raise ValueError(f"checkpoint {path} lacks weights for {sorted(missing)[:8]}")
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.hf_config.num_hidden_layers * self.block_size * self.num_kv_heads \
            * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.hf_config.num_hidden_layers)]

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[int]:
        """Run one iteration; returns the sampled token of every request with sample=True."""
        self.sampler.add(step.new_requests)
        if step.table_rows:
            idx = torch.tensor([step.table_rows, step.table_cols], device=self.device)
            self.block_table[idx[0], idx[1]] = torch.tensor(
                step.table_blocks, dtype=torch.int32, device=self.device)
        input_ids, positions, meta, logits_indices = self._prepare(step)
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices)
        sample_rows = [r for r, s in zip(step.rows, step.sample) if s]
        return self.sampler(logits, sample_rows).tolist()

    def _prepare(self, step: StepInput):
        query_lens = np.asarray(step.query_lens, dtype=np.int64)
        context_lens = np.asarray(step.context_lens, dtype=np.int64)
        cu_seqlens_q = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        seq_lens = context_lens + query_lens
        # token t of request i sits at position context_lens[i] + (t - cu_seqlens_q[i])
        positions = np.arange(cu_seqlens_q[-1]) - np.repeat(cu_seqlens_q[:-1] - context_lens,
                                                            query_lens)
        token_req = np.repeat(np.arange(len(query_lens)), query_lens)
        logits_indices = (cu_seqlens_q[1:] - 1)[np.asarray(step.sample, dtype=bool)]

        dev = self.device
        positions_t = torch.from_numpy(positions).to(dev)
        block_tables = self.block_table[torch.tensor(step.rows, device=dev)]  # [B, M]
        token_blocks = block_tables[torch.from_numpy(token_req).to(dev),
                                    positions_t // self.block_size]
        slot_mapping = token_blocks.long() * self.block_size + positions_t % self.block_size
        meta = AttentionMetadata(
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q).to(dev, torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
            block_tables=block_tables, slot_mapping=slot_mapping, block_size=self.block_size,
            cu_seqlens_q_host=cu_seqlens_q.tolist(), seq_lens_host=seq_lens.tolist())
        input_ids = torch.tensor(step.token_ids, dtype=torch.long, device=dev)
        return input_ids, positions_t, meta, torch.from_numpy(logits_indices).to(dev)
