"""vLLM's bad_words on the device: a word's last token is masked whenever the tokens
generated just before it are the rest of the word (a one-token word is always masked).

Only generated tokens count, never the prompt (as vLLM). Each row keeps its last P
generated tokens ([rows, P], P the longest word prefix in use), shifted in as tokens are
sampled; a request admitted again after preemption starts from its generated tokens. Words
are stored with their prefixes right-aligned to that window, so one comparison per word
decides it: [N, W, P] prefixes against [N, 1, P] recent tokens, where ANY matches anything.
"""
from __future__ import annotations

import numpy as np
import torch

ANY = -2  # a prefix place before a short word's prefix: matches any token
NONE = -1  # no token (a recent place before the first generated token; a padding word)


class BadWords:
    def __init__(self, num_rows: int, device: torch.device, staging):
        self.device, self.staging = device, staging
        self.recent = torch.full((num_rows, 0), NONE, dtype=torch.long, device=device)
        self.prefixes = torch.full((num_rows, 0, 0), ANY, dtype=torch.long, device=device)
        self.last = torch.full((num_rows, 0), NONE, dtype=torch.long, device=device)  # [rows, W]
        self.rows: set[int] = set()  # rows with bad words (host mirror)

    def add(self, row: int, words: tuple[tuple[int, ...], ...] | None,
            generated: tuple[int, ...] = ()) -> None:
        """A request admitted at `row`: its words' token ids (None: none) and its last
        generated tokens so far (a recomputed request's)."""
        if row in self.rows and not words:  # the row's previous request had some
            self.last[row] = NONE
        self.rows.discard(row)
        if not words:
            return
        self.rows.add(row)
        width = max(len(w) for w in words) - 1
        self._grow(width, len(words))
        p = self.recent.shape[1]
        prefixes = np.full((self.last.shape[1], p), ANY, np.int64)
        last = np.full(self.last.shape[1], NONE, np.int64)
        for i, word in enumerate(words):
            if len(word) > 1:
                prefixes[i, p - len(word) + 1:] = word[:-1]
            last[i] = word[-1]
        recent = np.full(p, NONE, np.int64)
        tail = list(generated)[-p:] if p else []
        recent[p - len(tail):] = tail
        table = self.staging.to_device(np.concatenate([prefixes.ravel(), last, recent]))
        n, w = prefixes.size, len(last)
        self.prefixes[row] = table[:n].view(w, p)
        self.last[row] = table[n:n + w]
        self.recent[row] = table[n + w:]

    def _grow(self, width: int, num_words: int) -> None:
        """Widen the tables to prefixes of `width` and `num_words` words per row."""
        rows, w, p = self.prefixes.shape
        if width > p:  # older places, on the left
            self.recent = torch.cat([self.recent.new_full((rows, width - p), NONE),
                                     self.recent], 1)
            self.prefixes = torch.cat([self.prefixes.new_full((rows, w, width - p), ANY),
                                       self.prefixes], 2)
            p = width
        if num_words > w:
            self.prefixes = torch.cat([self.prefixes,
                                       self.prefixes.new_full((rows, num_words - w, p), ANY)], 1)
            self.last = torch.cat([self.last, self.last.new_full((rows, num_words - w), NONE)], 1)

    def apply(self, logits: torch.Tensor, rows_host: list[int],
              rows: torch.Tensor) -> torch.Tensor:
        """Mask the words each row would complete next (logits [N, V], a new tensor)."""
        if not self.rows.intersection(rows_host):
            return logits
        prefixes, last = self.prefixes[rows], self.last[rows]  # [N, W, P], [N, W]
        recent = self.recent[rows][:, None, :]  # [N, 1, P]
        match = ((prefixes == recent) | (prefixes == ANY)).all(dim=-1) & (last >= 0)
        masked = torch.where(match, float("-inf"), 0.0)  # [N, W]
        return logits.scatter_add(1, last.clamp(min=0), masked)

    def sampled(self, rows_host: list[int], rows: torch.Tensor, ids: torch.Tensor) -> None:
        """The rows sampled `ids` [N]: shift them into their recent tokens."""
        if not self.rows.intersection(rows_host) or not self.recent.shape[1]:
            return
        self.recent[rows] = torch.cat([self.recent[rows][:, 1:], ids.long()[:, None]], 1)
