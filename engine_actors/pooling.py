"""runner "pooling": a decoder model serves embeddings, as vLLM's pooling runner does for
a causal LM (Qwen3-Embedding, gte-Qwen2, e5-mistral). A request runs its prompt only; the
step of its last prompt chunk returns the final (normed) hidden state of the last prompt
token instead of a sampled token, L2-normalized by default, and the request ends there.

A sentence-transformers checkpoint says how it pools in modules.json: its Pooling module's
config must pool the last token (other modes, mean or CLS, are refused at start), and a
Normalize module after it means normalized embeddings. Without modules.json: the last
token, normalized (vLLM's default for a causal LM).

A reranker made from a causal LM (vLLM's `classifier_from_token`, Qwen3-Reranker's ["no",
"yes"]) returns a logit instead: the LM head's rows of those tokens make a classifier of
the last hidden state, logit(yes) - logit(no) (one token: its logit), whose sigmoid
(deployments/score_api.py) is the probability of "yes" against "no".

A sequence classifier (`*ForSequenceClassification`: a reranker converted to one, a reward
model, a text classifier) is the same decoder with a head of its own (`score`): it returns
that head's logits, one per label (deployments/classify_api.py); with one label, it scores
pairs as a reranker does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_actors.messages import StepResult


@dataclass(slots=True)
class Pooling:
    normalize: bool = True
    token_ids: tuple[int, ...] = ()  # a classifier's tokens (their LM head rows score)
    num_labels: int = 0  # a sequence classifier's: its head `score.weight` gives the logits
    classifier: torch.Tensor | None = field(default=None, repr=False)  # [k, hidden], fp32


CLASSIFIER = "ForSequenceClassification"
CAUSAL_NAMES = {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM"}


def as_causal_lm(hf_config) -> None:
    """A sequence classifier's config names the causal LM of the same decoder (the model
    class that serves it), and keeps its own name in `sequence_classifier`. A multimodal
    one (its text model under `text_config`) is left as it is: not served."""
    name = (getattr(hf_config, "architectures", None) or [""])[0]
    if name.endswith(CLASSIFIER) and not hasattr(hf_config, "text_config"):
        causal = CAUSAL_NAMES.get(name, name.removesuffix(CLASSIFIER) + "ForCausalLM")
        hf_config.architectures = [causal]
        hf_config.sequence_classifier = name


def classifier_labels(hf_config, runner: str, classifier_tokens: list[str] | None
                      ) -> tuple[str, ...]:
    """A sequence classifier's labels, in order (none: it is no sequence classifier);
    ValueError for one that this engine cannot serve as given."""
    name = getattr(hf_config, "sequence_classifier", None)
    if name is None:
        return ()
    if runner != "pooling":
        raise ValueError(f"{name} is a sequence classifier: serve it with runner: pooling, "
                         "for /classify (and, with one label, /v1/score and /v1/rerank)")
    if classifier_tokens:
        raise ValueError(f"{name} scores with its own head: classifier_from_token is for a "
                         "causal LM's")
    return tuple(str(hf_config.id2label[i]) for i in range(hf_config.num_labels))


def read_pooling(path: str, classifier_tokens: list[str] | None = None,
                 num_labels: int = 0) -> Pooling:
    """The checkpoint's pooling (`num_labels`: a sequence classifier's; ValueError for one
    this engine does not do)."""
    if num_labels:
        return Pooling(normalize=False, num_labels=num_labels)
    if classifier_tokens:
        from tokenizers import Tokenizer  # (the Rust library: no transformers import here)
        vocab = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        ids = tuple(vocab.token_to_id(t) for t in classifier_tokens)
        if None in ids:
            raise ValueError(f"classifier_from_token {classifier_tokens}: "
                             f"{classifier_tokens[ids.index(None)]!r} is not one token of the "
                             "checkpoint's vocabulary")
        return Pooling(normalize=False, token_ids=ids)
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return Pooling()
    with open(modules_file) as f:
        modules = json.load(f)
    types = [m.get("type", "") for m in modules]
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            with open(os.path.join(path, m.get("path", ""), "config.json")) as f:
                config = json.load(f)
            modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
            if modes != ["pooling_mode_lasttoken"]:
                raise ValueError(f"the checkpoint pools with {modes or 'no mode'} "
                                 f"({m.get('path')}/config.json); runner pooling takes the "
                                 "last token's hidden state (pooling_mode_lasttoken) only")
    return Pooling(normalize=any(t.endswith("Normalize") for t in types))


def keep_classifier(pooling: Pooling | None, name: str, tensor: torch.Tensor, tied: bool,
                    device: torch.device) -> None:
    """As the checkpoint loads: a sequence classifier's head, or a classifier's rows of the
    LM head (of the embeddings, when the head is tied to them; a multimodal checkpoint's
    names end the same)."""
    head = "embed_tokens.weight" if tied else "lm_head.weight"
    if pooling is None:
        return
    if pooling.num_labels and name == "score.weight":
        if tensor.dtype.itemsize == 1:
            raise ValueError(f"the classifier head (score.weight) is in {tensor.dtype}: a "
                             "quantized head is not served")
        if tensor.shape[0] != pooling.num_labels:
            raise ValueError(f"the classifier head (score.weight) has {tensor.shape[0]} rows "
                             f"for the config's {pooling.num_labels} labels (id2label)")
        pooling.classifier = tensor.float().to(device)
    elif pooling.token_ids and name.endswith(head):
        pooling.classifier = tensor[list(pooling.token_ids)].float().to(device)


def embed(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Final hidden states [N, H] -> embeddings [N, H], or a classifier's logits [N, labels]
    (classifier_from_token's: [N, 1]); fp32."""
    out = hidden.float()
    if pooling.classifier is not None:
        logits = out @ pooling.classifier.T
        return logits[:, -1:] - logits[:, :1] if len(pooling.token_ids) == 2 else logits
    return F.normalize(out, dim=-1) if pooling.normalize else out


def embeddings_result(host: torch.Tensor) -> StepResult:
    """A pooling step's result: each sampling row's embedding as float32 bytes, which travel
    as they are to the route (its token: 0, unused)."""
    rows = host.numpy()
    return StepResult([0] * len(rows), embeddings=[row.tobytes() for row in rows])
