"""Speculative decoding with n-gram drafts (vLLM's speculative_config method "ngram", also
called prompt lookup decoding).

Before a decode step, the scheduler looks for the request's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its prompt and output; the tokens
that followed the latest such occurrence are its draft, up to num_speculative_tokens of them.
The step then runs the request's last token and its draft, and samples a token at each of
those positions with the request's own sampling settings. The drafts that equal the samples
before them are accepted, then one more sample: each step yields 1 to k + 1 tokens.

This is exact for any sampling settings. A draft d is accepted exactly when the token
sampled at its position is d, and every emitted token is a sample of the model's
distribution given the tokens before it (the accepted drafts are those tokens). It is the
rejection sampling of speculative decoding for a draft distribution with all its mass on d.

With async scheduling a request's next step is scheduled while its step with a draft is
still in flight: as if the whole draft were accepted, continuing from a guess of its last
sample (the lookup's first token), with a draft of its own. The worker finds the accepted
drafts on the device (accept_on_device), the next step continues from the last accepted
sample, and its tokens move back by the rejected drafts (shift_positions): the scheduler
marks such requests in StepInput.shifted and corrects its own counts when the result comes.

Requests with logits processors (penalties, bias, min_tokens, bad words, allowed ids, a
thinking budget), a grammar, or a seed with temperature > 0 are not speculated: their state
on the workers moves one token at a time. They decode as usual in the same steps.
"""
from __future__ import annotations

from array import array

from engine_actors.vllm_args import SpeculativeConfig
from engine_actors.kv_cache import KVCacheManager
from engine_actors.policies import Scheduled
from engine_actors.request import Request


class Speculator:
    def __init__(self, spec: SpeculativeConfig):
        self.k, self.n_min, self.n_max = spec.num_speculative_tokens, spec.min_n, spec.max_n
        self.max_batch = spec.disable_by_batch_size  # no drafts in a step this large
        # totals, as vLLM's spec_decode counters: drafts sent, their tokens, those accepted,
        # and the accepted ones by position in their draft
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k

    @staticmethod
    def can_speculate(req: Request) -> bool:
        s = req.sampling
        return not s.has_processors and s.grammar is None and (
            s.seed is None or s.temperature == 0.0)

    def propose(self, req: Request, max_len: int, extra: list[int] = ()) -> list[int]:
        """Up to max_len tokens that followed the latest earlier occurrence of the longest
        matching suffix of the request's tokens and then `extra`; [] when none occurs."""
        seen = req.draft_index
        if seen is None:
            seen = req.draft_index = array("i")
        seen.extend(req.token_ids[len(seen):])  # token_ids only grows
        data = seen.tobytes()
        tokens = req.token_ids
        if extra:
            data += array("i", extra).tobytes()
            tokens = tokens + list(extra)
        last = len(tokens) - 1  # an occurrence must end before the last token
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            suffix = data[4 * (len(tokens) - n):]
            end = 4 * last
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # a match of whole tokens
                    start = at // 4 + n
                    return tokens[start:start + max_len]
                end = at + len(suffix) - 1
        return []

    def draft(self, batch: list[Scheduled], kv: KVCacheManager,
              tokens_left: int) -> list[list[int]] | None:
        """Each scheduled request's draft (most empty), or None when none has one: decodes
        of requests that can be speculated, within the step's token budget and the KV each
        may still take. Grows their blocks; call after every request of the step has its
        own."""
        drafts: list[list[int]] = []
        if self.max_batch is not None and len(batch) >= self.max_batch:
            return None
        for item in batch:
            req = item.request
            # a decode: its one new token is its last sampled one, or the one its step in
            # flight samples (then its tokens are known up to that step's draft, taken as
            # accepted, and the lookup's first token is a guess of that sample)
            inflight = req.num_inflight_samples
            left = req.sampling.max_tokens - req.num_output_tokens - inflight - 1
            start = req.num_computed_tokens
            room = (len(req.blocks) + req.num_reserved_blocks + kv.num_unreserved_blocks) \
                * kv.block_size - start - 1
            max_len = min(self.k, left, tokens_left, room)
            if item.num_tokens != 1 or req.num_new_tokens != 1 or max_len <= 0 or \
                    not self.can_speculate(req):
                drafts.append([])
                continue
            guess = 1 if inflight else 0
            draft = self.propose(req, max_len + guess, req.draft if inflight else ())[guess:]
            if draft:
                kv.grow(req, start + 1 + len(draft))
                tokens_left -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else None

    def accept(self, draft: list[int], sampled: list[int]) -> list[int]:
        """The tokens a verified draft yields: the samples up to the first one that differs
        from its draft token, that one included (len(sampled) == len(draft) + 1). Counted
        here: a step's drafts whose request ended before its result came are not."""
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        n = 0
        while n < len(draft) and sampled[n] == draft[n]:
            self.accepted_per_position[n] += 1
            n += 1
        self.num_accepted_tokens += n
        return sampled[:n + 1]


# ---- on the workers: what the next step, already scheduled, continues from ------------------

def accept_on_device(sampled, inputs, last_sampled, shift) -> None:
    """After a step with drafts: each sampling row's accepted drafts, found on the device as
    the scheduler will find them (Speculator.accept). A step scheduled meanwhile continues
    from the row's last accepted sample (last_sampled) and places its tokens `shift` (minus
    the rejected drafts) from where the scheduler put them. sampled: [N] ids; inputs:
    the step's StepTensors."""
    import torch
    num_tokens = inputs.input_ids.shape[0]
    following = inputs.input_ids[(inputs.logits_indices[:len(sampled)].long() + 1)
                                 .clamp(max=num_tokens - 1)]  # the draft token after each
    group, offset = inputs.sample_group.long(), inputs.sample_offset.long()
    drafts = inputs.group_drafts.long()
    grid = torch.zeros(len(drafts), inputs.max_samples, dtype=torch.int32, device=sampled.device)
    grid[group, offset] = ((sampled == following) & (offset < drafts[group])).to(torch.int32)
    accepted = grid.cumprod(dim=1).sum(dim=1)
    first = inputs.group_first.long()
    rows = inputs.sample_rows[first].long()
    # (NO_TOKEN, of a row whose masks left none, ends its request: a step already in flight
    # reads a valid id meanwhile)
    last_sampled[rows] = sampled[first + accepted].clamp(min=0).to(torch.int32)
    shift[rows] = (accepted - drafts).to(torch.int32)


def shift_positions(inputs, shift) -> None:
    """Move the tokens of requests that continue from a step with drafts back by that
    step's rejected drafts (StepInput.shifted), before anything reads their positions."""
    tokens, reqs = inputs.shift_tokens.long(), inputs.shift_reqs.long()
    inputs.positions[tokens] += shift[inputs.token_rows[tokens].long()]
    inputs.seq_lens[reqs] += shift[inputs.rows[reqs].long()]
