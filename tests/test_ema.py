"""The moving average of a drafter's weights (online_opd/train/ema.py), on a tiny real drafter."""

from __future__ import annotations

import pytest
import torch

from online_opd.train.ema import WeightAverage
from tests.tiny import tiny_drafter


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _nudge(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.1)


def test_the_average_follows_the_warm_up_then_the_cap():
    """Decay of update n: min(decay, (1 + n) / (10 + n)); the average is the lerp it names, per tensor."""
    drafter = tiny_drafter()
    first = next(iter(drafter.named_parameters()))[0]
    drafter.get_parameter(first).requires_grad_(False)  # a frozen parameter is left out
    frozen = {n: p.detach().clone() for n, p in drafter.named_parameters() if not p.requires_grad}
    average = WeightAverage(drafter, decay=0.15)
    expected = _trainable(drafter)
    decays = []
    for n in range(3):
        _nudge(drafter, n)
        decays.append(average.next_decay())
        average.update(drafter)
        expected = {k: decays[-1] * v + (1 - decays[-1]) * p for (k, v), p in
                    zip(expected.items(), _trainable(drafter).values())}
    assert decays == pytest.approx([0.1, 0.15, 0.15])  # 1/10, then 2/11 = 0.18 > the cap
    assert average.num_updates == 3 and average.average.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(average.average[name], value, rtol=0, atol=1e-6)
    assert list(frozen) == [first] and first not in average.average


def test_decay_zero_is_the_weights_themselves_bit_for_bit():
    drafter = tiny_drafter()
    average = WeightAverage(drafter, decay=0.0)
    _nudge(drafter, 0)
    average.update(drafter)
    assert all(torch.equal(average.average[k], v) for k, v in _trainable(drafter).items())


def test_applied_to_swaps_the_average_in_and_the_weights_back_even_on_error():
    drafter = tiny_drafter()
    average = WeightAverage(drafter, decay=0.9)
    _nudge(drafter, 1)
    average.update(drafter)
    own = _trainable(drafter)
    assert any(not torch.equal(average.average[k], v) for k, v in own.items())
    with average.applied_to(drafter) as candidate:
        assert candidate is drafter
        assert all(torch.equal(p, average.average[k]) for k, p in _trainable(drafter).items())
    assert all(torch.equal(p, own[k]) for k, p in _trainable(drafter).items())
    with pytest.raises(RuntimeError, match="inside"):
        with average.applied_to(drafter):
            raise RuntimeError("inside")
    assert all(torch.equal(p, own[k]) for k, p in _trainable(drafter).items())


def test_state_round_trips_and_a_foreign_state_is_refused():
    drafter = tiny_drafter()
    average = WeightAverage(drafter, decay=0.5)
    _nudge(drafter, 2)
    average.update(drafter)
    restored = WeightAverage(tiny_drafter(seed=5), decay=0.5)
    restored.load_state_dict(average.state_dict())
    assert restored.num_updates == 1
    assert all(torch.equal(restored.average[k], v) for k, v in average.average.items())

    other = WeightAverage(tiny_drafter(num_layers=2), decay=0.5)
    before = {k: v.clone() for k, v in other.average.items()}
    with pytest.raises(ValueError, match="other parameters"):
        other.load_state_dict(average.state_dict())
    assert other.num_updates == 0 and all(torch.equal(other.average[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        WeightAverage(drafter, decay=1.0)
