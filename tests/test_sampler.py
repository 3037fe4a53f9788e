"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from radixkv.model.sampler import SamplingSpec, sample, seeded_generator


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    x = logits()
    assert sample(x, [SamplingSpec()] * 4, [None] * 4).tolist() == x.argmax(-1).tolist()


def test_seeds_make_sampling_reproducible_per_request():
    x = logits()
    spec = [SamplingSpec(temperature=1.0)] * 4
    a = sample(x, spec, [seeded_generator(s) for s in range(4)])
    b = sample(x, spec, [seeded_generator(s) for s in range(4)])
    assert a.tolist() == b.tolist()
    draws = {tuple(sample(x, spec, [seeded_generator(s + 10 * k) for s in range(4)]).tolist()) for k in range(20)}
    assert len(draws) > 1


@pytest.mark.parametrize("spec", [SamplingSpec(temperature=1.5, top_k=1), SamplingSpec(temperature=1.5, top_p=1e-6),
                                  SamplingSpec(temperature=1.5, top_p=1e-46),  # 0 in float32: the top token stays
                                  SamplingSpec(temperature=1e-40)])  # logits / T overflow: the shift keeps them finite
def test_top_k_one_and_tiny_top_p_are_greedy(spec):
    x = logits()
    for seed in range(10):
        assert sample(x, [spec] * 4, [seeded_generator(seed)] * 4).tolist() == x.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    x = logits(rows=1, vocab=20)
    allowed_k = set(torch.topk(x[0], 3).indices.tolist())
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = (probs[order].cumsum(0) - probs[order]) < 0.5
    allowed_p = set(order[keep].tolist())
    for seed in range(200):
        g = seeded_generator(seed)
        assert int(sample(x, [SamplingSpec(temperature=1.0, top_k=3)], [g])[0]) in allowed_k
        assert int(sample(x, [SamplingSpec(temperature=1.0, top_p=0.5)], [g])[0]) in allowed_p


def test_bad_specs_raise():
    with pytest.raises(ValueError):
        SamplingSpec(temperature=-1)
    with pytest.raises(ValueError):
        SamplingSpec(top_p=0)
