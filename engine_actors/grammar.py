"""Structured output: token masks from a grammar library (xgrammar), on the sampling worker.

A request's grammar (`SamplingParams.grammar`: a JSON schema, any JSON, a regex, an EBNF
grammar, or an xgrammar structural tag for tool calls) is compiled once per distinct spec
(cached) and followed by a matcher per table row. Each step, the rows that sample under a
grammar get a token bitmask filled on the CPU while the GPU runs the step's forward, then
applied to the logits on the device. A matcher advances when its step's sampled tokens reach
the host: a step that samples a grammar row first waits for the results of the steps before
it (the overlapped schedule lets the next step start before the previous token is known;
only its sampling waits). A request recomputed after preemption gets a fresh matcher that
replays its generated tokens.

A ("reasoning", ...) spec (deployments/structured.py, reasoning_grammar) is followed by an
AfterThinking matcher: no mask while a reasoning model thinks, its answer's grammar from
the </think> token on.
"""
from __future__ import annotations

import functools
import json
import logging
import re

import torch

from engine_actors.messages import StepResult

logger = logging.getLogger("orca_serve.worker")
# xgrammar 0.2.8 writes a JSON string with a length limit with characters of the class
# LOOSE_CHARS, which lets control characters other than CR and LF in unescaped (the output is
# then not JSON): it becomes JSON_CHARS. Its other string classes (plain strings, property
# names) start as STRICT_CHARS does, but every one lets in UTF-8 encoded surrogates
# (U+D800-DFFF), which are not text: decoded, each of their bytes becomes U+FFFD, so a string
# over its maxLength. They are excluded from all of them. (Strings with a `pattern` are
# matched by xgrammar's own regex rule, which this leaves as it is.)
LOOSE_CHARS = r'[^\"\\\r\n]'
JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'
STRICT_CHARS = re.compile(r'\[\^\\0-\\x1f((?:\\.|[^\]\\])*)\]')
NO_SURROGATES = r'\uD800-\uDFFF'


class Grammars:
    def __init__(self, model_path: str, vocab_size: int, threads: int | str = 1):
        self.model_path, self.vocab_size = model_path, vocab_size
        # of xgrammar's mask filling ("auto": half the CPU threads). One is fastest where
        # measured: 32 grammar rows of a 128k vocabulary on the H200 machine, 1.48 ms per
        # step on one thread, 2.42 on two, 3.78 on eight (BENCHMARKS.md).
        self.threads = threads
        self.matchers: dict[int, object] = {}  # row -> xgrammar GrammarMatcher
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher

    def _compile(self, spec: tuple[str, str]):
        import xgrammar as xgr
        if self._compiler is None:
            from engine_actors.checkpoint import load_tokenizer
            info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.model_path),
                                                      vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)  # caches compiled grammars
        return _compiled(self._compiler, spec)

    def add(self, row: int, spec: tuple[str, str] | None, replay: list[int]) -> None:
        """A request admitted at `row`; `replay`: the tokens it generated before (it is
        recomputed after preemption)."""
        self.matchers.pop(row, None)
        if spec is None:
            return
        import xgrammar as xgr
        matcher = AfterThinking(json.loads(spec[1]), self._compile) \
            if spec[0] == "reasoning" else xgr.GrammarMatcher(self._compile(spec))
        for token in replay:
            matcher.accept_token(token)
        self.matchers[row] = matcher

    def active(self, rows: list[int]) -> list[object | None]:
        """The matcher of each sampling row (None: no grammar)."""
        return [self.matchers.get(r) for r in rows]

    def bitmask(self, matchers: list[object | None]) -> torch.Tensor | None:
        """[N, V/32] int32 on the CPU: allowed tokens of each grammar row (others: all);
        None when no row has a mask (all still think)."""
        import xgrammar as xgr
        # a terminated one ended its request: a step already in flight samples a token the
        # scheduler drops
        rows, fill = [], []
        for i, m in enumerate(matchers):
            if isinstance(m, AfterThinking):
                m = m.matcher
            if m is not None and not m.is_terminated():
                rows.append(i)
                fill.append(m)
        if not rows:
            return None
        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self.threads)
        self._batch.batch_fill_next_token_bitmask(fill, mask, rows)
        return mask


class AfterThinking:
    """A reasoning model's grammar that starts at its </think> token: while it thinks, no
    mask and no matcher. With a `first` grammar (qwen3: the whole output's, thinking
    optional), that grammar masks the first token; the <think> token there starts the
    thinking, any other token the answer under that same grammar."""

    def __init__(self, spec: dict, compile_fn):
        import xgrammar as xgr
        self.end, self.start = spec["end"], spec["start"]
        self.answer = compile_fn(tuple(spec["answer"]))
        self.matcher = xgr.GrammarMatcher(compile_fn(tuple(spec["first"]))) \
            if spec["first"] is not None else None  # None: thinking
        self.is_first = spec["first"] is not None

    def accept_token(self, token: int) -> bool:
        import xgrammar as xgr
        if self.matcher is None:
            if token == self.end:
                self.matcher = xgr.GrammarMatcher(self.answer)
            return True
        accepted = self.matcher.accept_token(token)
        if self.is_first and token == self.start:
            self.matcher = None
        self.is_first = False
        return accepted

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


def _compiled(compiler, spec: tuple[str, str]):
    """The compiled grammar (xgrammar's compiler caches them by grammar text)."""
    kind, value = spec
    if kind in ("json_schema", "structural_tag"):
        return compiler.compile_grammar(json_grammar(kind, value))
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "ebnf":  # xgrammar's EBNF (GBNF-like), its root rule `root`
        return compiler.compile_grammar(value)
    raise ValueError(f"unknown grammar kind {kind!r}")


@functools.lru_cache(maxsize=256)
def json_grammar(kind: str, value: str) -> str:
    """The EBNF of a JSON schema or a structural tag (tool calls: JSON schemas inside),
    whose JSON strings hold only what JSON and UTF-8 allow (LOOSE_CHARS)."""
    import xgrammar as xgr
    if kind == "json_schema":  # whitespace bounded: weak models loop on it otherwise
        grammar = xgr.Grammar.from_json_schema(value, max_whitespace_cnt=1)
    else:
        grammar = xgr.Grammar.from_structural_tag(value)
    text = str(grammar).replace(LOOSE_CHARS, JSON_CHARS)
    return STRICT_CHARS.sub(lambda m: f"[^\\0-\\x1f{m.group(1)}{NO_SURROGATES}]", text)


def check_grammar(spec: tuple[str, str]) -> None:
    """Raise ValueError when a grammar spec cannot be compiled, or matches no text at all
    (a schema that only refers to itself, an empty character class), before it reaches
    the engine: the ingress answers 400. Its mask would allow no token, and the request
    would sample garbage."""
    import xgrammar as xgr
    kind, value = spec
    if kind not in ("json_schema", "structural_tag", "regex", "ebnf"):
        return
    try:
        grammar = _compiled(_bytes_compiler(), spec)  # as the engine will
    except Exception as e:  # xgrammar raises RuntimeError("[time] file.cc:line: message")
        message = str(e).strip().splitlines()[-1]
        raise ValueError(re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)) from None
    # over single bytes and an end token, every text (and the empty one) has a first token
    mask = xgr.allocate_token_bitmask(1, 257)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
    if not mask.any():
        raise ValueError("no text matches it")


@functools.cache
def _bytes_compiler():
    """A grammar compiler over a vocabulary of the 256 bytes and an end token (cheap to
    compile for: checks that need no model's tokenizer). It keeps nothing: every request's
    grammar passes through it, and its cache would grow without bound."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def advance(matchers: list[object | None], result: StepResult) -> StepResult:
    """A step's tokens reached the host: the matchers of its grammar rows accept them."""
    for m, token in zip(matchers, result.token_ids):
        if m is not None and token >= 0 and not m.is_terminated() and \
                not m.accept_token(token):  # (NO_TOKEN: the request ends)
            # the mask allowed it, so this is a bug; the request's output may not follow its
            # grammar from here
            logger.error("orca-serve: a grammar matcher rejected sampled token %d", token)
    return result


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32 (a new tensor), the mask [N, V/32] int32 on the same device."""
    import xgrammar as xgr
    logits = logits.clone()
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1])
    return logits
