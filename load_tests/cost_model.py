"""A linear model of one iteration's wall time, calibrated from step times measured on this
engine, for the scheduling simulator (load_tests/simulator.py).

    t = c0 + c_prefill * prefill_tokens + c_decode * decode_requests
           [+ c_prefill_req * prefill_requests] [+ c_ctx * context_tokens]
           [+ c_prefill_attn * prefill_attention_pairs]

A decode request is a row with one new token after a non-empty context; every other row is
a prefill (chunk), whose new tokens are prefill tokens. context_tokens sums the cached
context of every row of the batch (what attention reads besides the new tokens);
prefill_attention_pairs sums query x key pairs of the prefill rows, q * (context + q), the
part of a prompt's cost that grows with its square. The bracketed terms enter only when
they cut the fit's relative error clearly (forward selection, see `select`): on CPU,
attention runs one torch loop per request, so a request costs a fixed amount besides its
tokens, decode attention grows with its context and prefill attention with the prompt's
square.

    python -m load_tests.cost_model --out load_tests/results/policies/cost_model_cpu.json
    python -m load_tests.cost_model --device cuda --model llama-8b --out cost_h200.json

Calibration = `calibration.measure_grid` (runner.execute on synthetic steps, in-process) +
`calibration.measure_actor_overhead` (the scheduler actor loop through Ray, folded into c0
and the per-request terms).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from engine_actors.messages import StepInput

TERMS = ("c0", "c_prefill", "c_decode", "c_prefill_req", "c_ctx", "c_prefill_attn")
BASE_TERMS = ("c0", "c_prefill", "c_decode")
OPTIONAL_TERMS = ("c_prefill_req", "c_ctx", "c_prefill_attn")
MIN_GAIN = 0.10  # an optional term must cut the relative RMS error by 10% to enter


@dataclass(frozen=True, slots=True)
class StepFeatures:
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    context_tokens: int = 0
    prefill_attention_pairs: int = 0

    def vector(self, terms: tuple[str, ...]) -> list[float]:
        values = {"c0": 1.0, "c_prefill": self.prefill_tokens, "c_decode": self.decode_requests,
                  "c_prefill_req": self.prefill_requests, "c_ctx": self.context_tokens,
                  "c_prefill_attn": self.prefill_attention_pairs}
        return [float(values[t]) for t in terms]


def step_features(step: StepInput) -> StepFeatures:
    """The cost-relevant shape of a step message (shared by calibration and simulation, so
    both classify rows the same way)."""
    prefill_tokens = prefill_requests = decode_requests = pairs = 0
    for ctx, n in zip(step.context_lens, step.query_lens):
        if n == 1 and ctx > 0:
            decode_requests += 1
        else:
            prefill_requests += 1
            prefill_tokens += n
            pairs += n * (ctx + n)
    return StepFeatures(prefill_tokens, prefill_requests, decode_requests,
                        sum(step.context_lens), pairs)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per iteration. Terms left at 0 are not part of the model."""
    c0: float
    c_prefill: float
    c_decode: float
    c_prefill_req: float = 0.0
    c_ctx: float = 0.0
    c_prefill_attn: float = 0.0

    def step_time(self, f: StepFeatures) -> float:
        return (self.c0 + self.c_prefill * f.prefill_tokens + self.c_decode * f.decode_requests
                + self.c_prefill_req * f.prefill_requests + self.c_ctx * f.context_tokens
                + self.c_prefill_attn * f.prefill_attention_pairs)

    @classmethod
    def load(cls, path: str) -> CostModel:
        """The `model` of a calibration JSON written by this module's CLI."""
        with open(path) as f:
            data = json.load(f)
        if "model" not in data:
            raise ValueError(f"{path}: not a cost-model calibration (no 'model' key)")
        return cls(**data["model"])

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Fit:
    terms: tuple[str, ...]
    coefs: dict[str, float]
    r2: float  # of the times in seconds
    rel_rmse: float  # root mean square of the relative errors, what the fit minimises
    rel_median: float
    rel_p90: float


def fit(features: list[StepFeatures], times_s: list[float], terms: tuple[str, ...]) -> Fit:
    """Least squares of the *relative* error (rows weighted by 1/time): steps range from
    about one millisecond to a hundred, and a plain fit in seconds would serve the largest
    steps and miss the small decode steps that dominate serving by a large factor."""
    x = np.array([f.vector(terms) for f in features])  # [N, K]
    y = np.array(times_s)  # [N]
    if len(y) <= len(terms):
        raise ValueError(f"{len(y)} measurements cannot fit {len(terms)} terms")
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    resid = y - x @ coef
    rel = np.abs(resid) / y
    r2 = 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())
    return Fit(terms, dict(zip(terms, map(float, coef))), r2, float(np.sqrt(np.mean(rel ** 2))),
               float(np.median(rel)), float(np.percentile(rel, 90)))


def select(features: list[StepFeatures], times_s: list[float]) -> tuple[Fit, list[Fit]]:
    """Forward selection from the three-term model: each round adds the optional term that
    lowers the relative RMS error most, if it lowers it by MIN_GAIN or more. Returns
    (chosen, every model tried)."""
    chosen = fit(features, times_s, BASE_TERMS)
    tried = [chosen]
    while True:
        trials = [fit(features, times_s, chosen.terms + (t,))
                  for t in OPTIONAL_TERMS if t not in chosen.terms]
        tried += trials
        best = min(trials, key=lambda f: f.rel_rmse, default=None)
        if best is None or best.rel_rmse > (1.0 - MIN_GAIN) * chosen.rel_rmse:
            return chosen, tried
        chosen = best


def model_of(f: Fit) -> CostModel:
    return CostModel(**{t: f.coefs.get(t, 0.0) for t in TERMS})


def main(argv: list[str] | None = None) -> dict:
    from load_tests.calibration import main as calibrate
    return calibrate(argv)


if __name__ == "__main__":
    main()
