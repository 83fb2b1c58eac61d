"""How much memory a fine-tuning micro-batch gets (engine_actors/finetune_jobs.py): the
memory free beside the KV pool, plus KV blocks the pool lends (kv_memory.py), against the
job's measured peak memory per token with a margin."""
from __future__ import annotations

from engine_actors.finetune_job import Job

MEMORY_MARGIN = 1.25  # over the measured peak memory per token


def plan_micro_batch(job: Job, kv, m: dict, max_tokens: int) -> tuple[int, list[int]] | None:
    """The next micro-batch of `job` (example indices) and the KV units lent for it in
    all; None when it does not fit in the memory that can be freed now. Raises
    ValueError when its next example could never fit."""
    if m["free_bytes"] is None:  # CPU: not bounded by the device
        return 0, job.peek_micro(max_tokens)  # examples fit the cap
    per_token = MEMORY_MARGIN * (job.bytes_per_token or m["bytes_per_token_guess"])
    unit_bytes, unit_blocks, lendable = (m["lend_unit_bytes"], m["lend_unit_blocks"],
                                         m["lendable_units"])
    first = job.next_length()
    most = m["free_bytes"] + lendable * unit_bytes  # with every lendable block lent
    if per_token * first > most:
        raise ValueError(f"a training example of {first} tokens needs about "
                         f"{per_token * first / 2**30:.2f} GiB for a step; at most "
                         f"{most / 2**30:.2f} GiB can be freed for training")
    # until its memory per token is measured, a job's micro-batch is one example
    tokens = first if job.bytes_per_token is None else max_tokens
    possible = kv.can_lend(lendable, unit_blocks, lendable)
    micro = job.peek_micro(min(tokens, int((m["free_bytes"] + possible * unit_bytes)
                                           / per_token)))
    if not micro:  # running requests or reservations hold the memory it needs
        return None
    have = kv.num_lent_blocks // unit_blocks  # lent for an earlier step
    short = per_token * sum(len(job.examples[i][0]) for i in micro) \
        - m["free_bytes"] - have * unit_bytes
    if short <= 0 or not unit_bytes:
        return have, micro
    return kv.lend(have + -(-int(short) // unit_bytes), unit_blocks, lendable), micro


def training_memory(runner, device: str, held: int) -> dict:
    """A worker's answer on what a training step may use: device memory free beside the KV
    pool (None on CPU: not bounded here; `held`: what the caching allocator holds and cannot
    give back) and how the pool lends blocks (kv_memory.py)."""
    import torch
    unit_blocks, units, unit_bytes = runner.kv_memory.lendable()
    free = None
    if device == "cuda":
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - held
        free = torch.cuda.mem_get_info()[0] + max(0, cached) - runner.kv_memory.lent_bytes
    hf = runner.model.config  # activations kept for the backward pass, roughly
    guess = runner.model.embed_tokens.weight.element_size() * hf.num_hidden_layers \
        * (16 * hf.hidden_size + 6 * hf.intermediate_size)
    return {"free_bytes": free, "lend_unit_blocks": unit_blocks, "lendable_units": units,
            "lend_unit_bytes": unit_bytes, "bytes_per_token_guess": guess,
            # the allocator freed its cache and retried (slow): memory ran short
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)
            if device == "cuda" else 0}
