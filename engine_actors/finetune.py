"""LoRA fine-tuning on a worker, through the served model's own weights (FineInfer §2.4).

A `Trainer` holds one job's LoRA parameters (fp32 masters, whatever the model's dtype), its
AdamW state, and runs micro-batches: forward and backward through the stage's model with
the base weights frozen, gradients accumulated until the batch's last micro-batch steps
the optimizer. The forward is the model's own architecture written with the kernels'
differentiable torch references, on the flattened tokens of the micro-batch (selective
batching, as in inference): attention runs per sequence, causal, without a KV cache.
`save` writes the adapter in PEFT's format, which the LoRA serving path (and peft) loads.

With tensor parallelism every rank of the stage trains its shards, as the serving path
shards adapters: a column-parallel projection's B by output rows (A whole), a row-parallel
one's A by input columns (B whole). As in Megatron, a column-parallel input all-reduces its
gradient in the backward pass and a row-parallel output all-reduces its partial sums in the
forward pass; the whole tensors (column-parallel A, row-parallel B) sum their partial
gradients over the ranks before the optimizer steps, and the logits' vocabulary shards are
gathered for the loss. Pipeline stages are not supported for training.
"""
from __future__ import annotations

import json
import itertools
import math
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine_actors.layers.lora import MODULES
from engine_actors.training_ops import (CopyToRanks, SumOverRanks, causal_attention,
                                        rms_norm, rotary_tables, rotate, row_parallel,
                                        varlen_attention, varlen_gqa)
from kernels.act_mul import act_mul_ref

class Trainer:
    def __init__(self, model, rank: int, alpha: float, targets: list[str], lr: float,
                 seed: int = 0):
        parallel = model.parallel
        if parallel.pp_size > 1:
            raise ValueError("fine-tuning with pipeline parallelism is not supported: "
                             "serve with pipeline_parallel_size 1 to fine-tune")
        if parallel.tp_size > model.config.num_key_value_heads:
            raise ValueError(f"fine-tuning with tensor_parallel_size {parallel.tp_size} above "
                             f"the model's {model.config.num_key_value_heads} KV heads (which "
                             "then replicate) is not supported")
        self.model, self.rank, self.alpha, self.targets = model, rank, alpha, list(targets)
        # one flash call per layer for all sequences (CUDA, half precision): far fewer host
        # ops than a call per sequence, the step being host-bound
        self.varlen = varlen_attention() is not None
        self.parallel, self.scale = parallel, alpha / rank
        gen = torch.Generator().manual_seed(seed)  # the same draws on every rank
        self.params: dict[tuple[str, str], tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self.whole: list[torch.nn.Parameter] = []  # on every rank in full: gradients summed
        self.trained: dict[int, list[str | None]] = {}  # id(projection) -> target per part
        for layer_id, layer in model.layers.items():
            for target in self.targets:
                module_path, part = MODULES[target]
                module = layer.get_submodule(module_path)
                parts = self.trained.setdefault(id(module),
                                                [None] * len(getattr(module, "parts", [0])))
                parts[part] = target
                row = row_parallel(module)
                out = module.weight.shape[0] if row else module.part_sizes[part]
                in_features = module.weight.shape[1] * (parallel.tp_size if row else 1)
                a = torch.empty(rank, in_features)
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # as peft
                dev = module.weight.device
                a = torch.nn.Parameter((module.local_columns(a) if row else a).to(dev))
                b = torch.nn.Parameter(torch.zeros(out, rank, device=dev))
                self.params[layer_id, target] = (a, b)
                self.whole.append(b if row else a)
        self.optimizer = torch.optim.AdamW([p for ab in self.params.values() for p in ab],
                                           lr=lr, weight_decay=0.0)
        self._create_state()

    def _create_state(self) -> None:
        """The gradients and AdamW's moments, allocated now rather than at the first step:
        a step then allocates nothing that outlives it, so memory lent to it by the KV pool
        is all free again afterwards. (AdamW builds its state in a step: one with learning
        rate 0 and zero gradients changes no parameter and leaves zero moments; its step
        count is reset.)"""
        for ab in self.params.values():
            for p in ab:
                p.grad = torch.zeros_like(p)
        group = self.optimizer.param_groups[0]
        lr, group["lr"] = group["lr"], 0.0
        self.optimizer.step()
        group["lr"] = lr
        for state in self.optimizer.state.values():
            state["step"].zero_()

    # ---- one micro-batch ----------------------------------------------------------------
    def micro_step(self, sequences: list[list[int]], masks: list[list[bool]],
                   batch_loss_tokens: int, last: bool) -> dict:
        """Forward and backward of these sequences; masks[i][t]: token t is trained on
        (predicted from the tokens before it). The loss is the summed cross-entropy over the
        batch's `batch_loss_tokens` trained tokens, so micro-batches add up to the batch
        mean. `last`: the batch's last micro-batch, the optimizer steps."""
        start = time.perf_counter()
        cuda = self.model.embed_tokens.weight.is_cuda
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with torch.enable_grad():
            logits, targets = self.forward(sequences, masks)
            loss_sum = F.cross_entropy(logits, targets, reduction="sum")
            (loss_sum / batch_loss_tokens).backward()
        if last:
            self.sum_gradients()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)  # kept: see _create_state
        if cuda:
            torch.cuda.synchronize()
        return {"loss_sum": float(loss_sum.detach()), "loss_tokens": int(targets.numel()),
                "tokens": sum(len(s) for s in sequences),
                "elapsed_s": time.perf_counter() - start,
                # the step's memory beyond what was allocated before it (CUDA only)
                "peak_bytes": torch.cuda.max_memory_allocated() - base if cuda else None}

    def sum_gradients(self) -> None:
        """Tensor parallelism: the whole tensors' partial gradients, summed over the ranks
        (collective; once per batch, before the optimizer steps)."""
        if self.parallel.tp_size > 1:
            for p in self.whole:
                if p.grad is not None:
                    self.parallel.all_reduce(p.grad)

    def forward(self, sequences: list[list[int]], masks: list[list[bool]]):
        """fp32 logits at the positions before each trained token, and those tokens."""
        return self.forward_tensors(*self.inputs(sequences, masks))

    def inputs(self, sequences: list[list[int]], masks: list[list[bool]]) -> tuple:
        """The micro-batch as device tensors for `forward_tensors`: token ids, positions,
        sequence starts (varlen attention) or None, the sequences' lengths, and the flat
        index of each position whose next token is trained on."""
        if len(masks) != len(sequences) or any(len(m) != len(s)
                                               for s, m in zip(sequences, masks)):
            raise ValueError("every sequence needs a mask of its own length")
        dev = self.model.embed_tokens.weight.device
        ids = torch.tensor([t for s in sequences for t in s], device=dev)
        lens = [len(s) for s in sequences]
        positions = torch.tensor([p for n in lens for p in range(n)], device=dev)
        cu = None
        if self.varlen and ids.is_cuda and self.model.embed_tokens.weight.dtype in (
                torch.float16, torch.bfloat16):
            cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32,
                              device=dev)
        # position t predicts token t + 1 of the same sequence
        flat_masks = [m for mask in masks for m in list(mask[1:]) + [False]]
        trained = torch.tensor([i for i, m in enumerate(flat_masks) if m], device=dev,
                               dtype=torch.long)
        return ids, positions, cu, lens, trained

    def forward_tensors(self, ids, positions, cu, lens: list[int], trained):
        """`forward` on `inputs`' tensors, with no host-device copy or sync (a CUDA graph can
        capture it): fp32 logits at the `trained` positions, and the tokens they predict."""
        model = self.model
        hidden, residual = model.embed_tokens(ids), None
        self._low = self.lora_views(*self.cast_lora(hidden.dtype))
        tables = {}  # rotary module -> its cos and sin at these positions
        for layer_id, layer in model.layers.items():
            hidden, residual = self.layer_forward(layer_id, layer, hidden, residual, tables,
                                                  positions, lens, cu)
        self._low = None
        return self.head(hidden, residual, ids, trained)

    def head(self, hidden, residual, ids, trained):
        """The final norm and the fp32 logits at the `trained` positions; their targets."""
        hidden, _ = rms_norm(hidden, self.model.norm.weight, self.model.norm.eps, residual)
        targets = torch.roll(ids, -1).index_select(0, trained)
        return self._logits(hidden.index_select(0, trained)).float(), targets

    def layer_forward(self, layer_id: str, layer, hidden, residual, tables: dict, positions,
                      lens: list[int], cu):
        """One decoder layer on the flattened tokens: (hidden, residual) in and out
        (`residual` None before the first layer); `tables` caches the rotary tables."""
        if residual is None:
            residual, x = hidden, rms_norm(hidden, layer.input_layernorm.weight,
                                           layer.input_layernorm.eps)
        else:
            x, residual = rms_norm(hidden, layer.input_layernorm.weight,
                                   layer.input_layernorm.eps, residual)
        rotary = layer.self_attn.rotary
        if id(rotary) not in tables:
            tables[id(rotary)] = rotary_tables(rotary, positions, hidden.dtype)
        hidden = self._attention(layer_id, layer.self_attn, x, tables[id(rotary)], lens, cu)
        norm = layer.post_attention_layernorm
        x, residual = rms_norm(hidden, norm.weight, norm.eps, residual)
        mlp = layer.mlp
        return self._linear(layer_id, mlp.down_proj, act_mul_ref(
            self._linear(layer_id, mlp.gate_up_proj, x))), residual

    def _logits(self, hidden):
        """Full-vocabulary logits. With tensor parallelism each rank computes its vocabulary
        shard; the others' arrive without gradient, since every rank computes the same loss
        and needs only its own shard's share of the gradient."""
        if self.parallel.tp_size == 1:
            return F.linear(hidden, self.model.lm_head.weight)
        # vocabulary-sharded outputs of a replicated input: its gradient sums over ranks
        local = F.linear(CopyToRanks.apply(hidden, self.parallel), self.model.lm_head.weight)
        parts = list(self.parallel.all_gather_last_dim(local.detach()).chunk(
            self.parallel.tp_size, dim=-1))
        parts[self.parallel.tp_rank] = local
        return torch.cat(parts, dim=-1)[:, :self.model.config.vocab_size]

    def _attention(self, layer_id, attn, x, tables, lens, cu=None):
        q, k, v = self._linear(layer_id, attn.qkv_proj, x).split(attn.qkv_proj.part_sizes, -1)
        d = attn.head_dim
        if attn.qk_norm:
            q = rms_norm(q.reshape(-1, d), attn.q_norm.weight, attn.q_norm.eps)
            k = rms_norm(k.reshape(-1, d), attn.k_norm.weight, attn.k_norm.eps)
        q = rotate(q.reshape(-1, attn.num_heads, d), *tables)
        k = rotate(k.reshape(-1, attn.num_kv_heads, d), *tables)
        v = v.reshape(-1, attn.num_kv_heads, d)
        if cu is None or not varlen_gqa():  # KV heads repeated for each query head
            group = attn.num_heads // attn.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = causal_attention(q, k, v, lens, cu)
        return self._linear(layer_id, attn.o_proj, out.flatten(1))

    def cast_lora(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All LoRA weights in the model's dtype for a forward pass, B already scaled: one
        cast for all A and one for all B (differentiable back to the fp32 masters),
        instead of two casts and a scaling per projection. Flat: see `lora_views`."""
        keys = list(self.params)
        return (torch.cat([self.params[k][0].flatten() for k in keys]).to(dtype),
                (torch.cat([self.params[k][1].flatten() for k in keys]) * self.scale).to(dtype))

    def lora_views(self, a_all: torch.Tensor, b_all: torch.Tensor, keys=None) -> dict:
        """(layer, target) -> its (A, B), views of `cast_lora`'s flat tensors (or of the
        slices that hold `keys`, consecutive keys of `self.params`)."""
        keys = list(self.params) if keys is None else keys
        a_parts = a_all.split([self.params[k][0].numel() for k in keys])
        b_parts = b_all.split([self.params[k][1].numel() for k in keys])
        return {k: (a.view(self.params[k][0].shape), b.view(self.params[k][1].shape))
                for k, a, b in zip(keys, a_parts, b_parts)}

    def _linear(self, layer_id: str, module, x):
        """The frozen projection plus this job's low-rank updates of its trained parts
        (this rank's shard of the output, or the full output of a row-parallel one)."""
        row, tp = row_parallel(module), self.parallel.tp_size > 1
        if tp and not row:
            x = CopyToRanks.apply(x, self.parallel)
        out = F.linear(x, module.weight)
        targets = self.trained.get(id(module))
        if targets is not None:
            deltas = []
            for target, size in zip(targets, getattr(module, "part_sizes", [out.shape[-1]])):
                if target is None:
                    deltas.append(out.new_zeros(x.shape[0], size))
                    continue
                a, b = self._low[layer_id, target]
                deltas.append(F.linear(F.linear(x, a), b))  # x A^T B^T
            out = out + torch.cat(deltas, -1)
        if tp and row:
            out = SumOverRanks.apply(out, self.parallel)
        return out if module.bias is None else out + module.bias

    def state_bytes(self) -> int:
        """Device bytes of the parameters, their gradients and AdamW's moments."""
        tensors = [p for ab in self.params.values() for p in ab]
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [v for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- the adapter --------------------------------------------------------------------
    def save(self, path: str, base_model: str) -> None:
        """PEFT's adapter_config.json and adapter_model.safetensors (collective with tensor
        parallelism: the shards are gathered, the first rank writes)."""
        tensors = {}
        for (layer_id, target), (a, b) in self.params.items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer_id}.{block}.{target}"
            module = self.model.layers[layer_id].get_submodule(MODULES[target][0])
            a, b = a.detach().float(), b.detach().float()
            if row_parallel(module):  # A's input columns were sharded
                a = self.parallel.all_gather_last_dim(a)
            else:  # B's output rows (this part's heads) were sharded
                b = self.parallel.all_gather_last_dim(b.T.contiguous()).T
            tensors[f"{key}.lora_A.weight"] = a.cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = b.cpu().contiguous()
        if self.parallel.tp_rank != 0:
            return
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
                  "lora_alpha": self.alpha, "target_modules": self.targets, "bias": "none",
                  "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True,
                  "base_model_name_or_path": base_model}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)

