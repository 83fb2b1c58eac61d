from __future__ import annotations

import pytest
import torch

from engine_actors.messages import NewRequest
from engine_actors.sampler import Sampler


def make_sampler(params: dict[int, tuple], seed=0, device="cpu"):
    """params: row -> (temperature, top_p, top_k, seed[, min_p])."""
    s = Sampler(max_num_seqs=8, device=torch.device(device), seed=seed)
    s.add([NewRequest(row, *p) for row, p in params.items()])
    return s


def frequencies(sampler, logits, row, n=20000):
    counts = torch.zeros(logits.shape[-1])
    batch = logits.expand(n, -1).clone()
    # one big batch of the same row is n independent draws from the shared generator
    sampler.is_greedy[row] = False
    ids = sampler(batch, [row] * n, torch.full((n,), row, device=logits.device))
    counts += torch.bincount(ids, minlength=logits.shape[-1]).cpu()
    return counts / n


def test_greedy_and_degenerate_truncation_pick_the_argmax():
    logits = torch.randn(3, 50)
    s = make_sampler({0: (0.0, 1.0, 0, None), 1: (1.0, 1.0, 1, None), 2: (0.7, 1e-6, 0, None)})
    assert torch.equal(s(logits, [0, 1, 2], torch.arange(3)), logits.argmax(-1))


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = make_sampler({0: (1.0, 1.0, 0, None), 1: (0.5, 1.0, 0, None)})
    torch.testing.assert_close(frequencies(s, logits, 0), torch.softmax(logits[0], -1),
                               atol=0.015, rtol=0)
    torch.testing.assert_close(frequencies(s, logits, 1), torch.softmax(logits[0] / 0.5, -1),
                               atol=0.015, rtol=0)


def test_top_k_and_top_p_truncate_then_renormalise():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    s = make_sampler({0: (1.0, 1.0, 2, None), 1: (1.0, 0.7, 0, None), 2: (1.0, 0.9, 3, None)})
    expect_k2 = torch.tensor([0.625, 0.375, 0.0, 0.0])
    torch.testing.assert_close(frequencies(s, logits, 0), expect_k2, atol=0.015, rtol=0)
    # top_p 0.7: tokens 0 and 1 (mass 0.8 is the smallest prefix reaching 0.7)
    torch.testing.assert_close(frequencies(s, logits, 1), expect_k2, atol=0.015, rtol=0)
    # top_k 3 then top_p 0.9 of the renormalised [0.526, 0.316, 0.158]: all three stay
    expect = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(frequencies(s, logits, 2), expect, atol=0.015, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_min_p_keeps_tokens_near_the_likeliest_after_temperature(device):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].to(device)
    s = make_sampler({0: (1.0, 1.0, 0, None, 0.4), 1: (0.5, 1.0, 0, None, 0.1),
                      2: (1.0, 0.5, 0, None, 0.2), 3: (0.0, 1.0, 0, None, 0.9)}, device=device)
    # p >= 0.4 * 0.5 keeps tokens 0 and 1, renormalised
    torch.testing.assert_close(frequencies(s, logits, 0), torch.tensor([0.625, 0.375, 0, 0]),
                               atol=0.015, rtol=0)
    # at temperature 0.5, p is [0.685, 0.247, 0.062, 0.007]: 0.1 * 0.685 keeps two tokens
    # (on the untempered p, 0.1 * 0.5 would have kept all four)
    sharp = probs[:2] ** 2 / (probs[:2] ** 2).sum()
    torch.testing.assert_close(frequencies(s, logits, 1), torch.cat([sharp, torch.zeros(2)]),
                               atol=0.015, rtol=0)
    # min_p 0.2 keeps [0.5, 0.3, 0.15] (renormalised 0.526...), then top_p 0.5 the first
    torch.testing.assert_close(frequencies(s, logits, 2), torch.tensor([1.0, 0, 0, 0]),
                               atol=0.0, rtol=0)
    assert s(logits, [3], torch.tensor([3], device=device)).item() == 0  # greedy: no min_p


def test_seeded_request_is_reproducible_in_any_batch():
    torch.manual_seed(0)
    steps = [torch.randn(5, 300) for _ in range(6)]
    alone = make_sampler({0: (1.0, 0.95, 50, 1234)}, seed=1)
    crowd = make_sampler({3: (1.0, 0.95, 50, 1234), 1: (1.0, 1.0, 0, None),
                          5: (0.8, 1.0, 0, 99), 2: (0.0, 1.0, 0, None)}, seed=2)
    a = [alone(x[2:3], [0], torch.tensor([0])).item() for x in steps]
    b = [crowd(x[[0, 1, 2, 3]], [1, 5, 3, 2], torch.tensor([1, 5, 3, 2]))[2].item()
         for x in steps]
    assert a == b
    other_seed = make_sampler({0: (1.0, 0.95, 50, 4321)}, seed=1)
    assert [other_seed(x[2:3], [0], torch.tensor([0])).item() for x in steps] != a


def test_seeded_request_recomputed_after_preemption_resumes_its_stream():
    """The workers learn a recomputed request with num_skip_draws = tokens it sampled
    before: its next tokens are those it would have sampled without the preemption."""
    torch.manual_seed(1)
    steps = [torch.randn(1, 300) for _ in range(6)]
    first = make_sampler({0: (1.0, 1.0, 0, 77)})
    tokens = [first(x, [0], torch.tensor([0])).item() for x in steps]
    resumed = Sampler(max_num_seqs=8, device=torch.device("cpu"), seed=0)
    resumed.add([NewRequest(4, 1.0, 1.0, 0, 77, num_skip_draws=3)])
    assert [resumed(x, [4], torch.tensor([4])).item() for x in steps[3:]] == tokens[3:]
