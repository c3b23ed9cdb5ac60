"""Unbiased pass@k against the closed form 1 − C(n−c, k) / C(n, k) on hand-made counts."""

from math import comb, isnan

import pytest
import torch

from lit_rlvr.functional.passk import mean_at_k, pass_at_k


def closed_form(c: int, n: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_matches_closed_form(k):
    c = torch.tensor([0, 1, 2, 3, 5, 7, 8])
    value, metrics = pass_at_k(c, 8, k)
    expected = torch.tensor([closed_form(int(ci), 8, k) for ci in c])
    assert value.dtype == torch.float32 and value.shape == (7,)
    assert torch.allclose(value, expected.float(), atol=1e-6)
    assert torch.allclose(metrics["pass@k"], expected.mean().float(), atol=1e-6)


def test_hand_worked_values():
    # n = 4, c = 1, k = 2: 1 − C(3,2)/C(4,2) = 1 − 3/6 = 0.5;  n = 5, c = 2, k = 2: 1 − C(3,2)/C(5,2) = 0.7
    value, _ = pass_at_k(torch.tensor([1, 2]), torch.tensor([4, 5]), 2)
    assert value.tolist() == pytest.approx([0.5, 0.7])


def test_k1_is_accuracy():
    c, n = torch.tensor([0, 1, 3, 16, 5]), torch.tensor([16, 16, 16, 16, 7])
    value, _ = pass_at_k(c, n, 1)
    assert torch.allclose(value, c.float() / n.float())
    assert torch.allclose(mean_at_k(c, n)[0], c.float() / n.float())


def test_edge_cases():
    value, _ = pass_at_k(torch.tensor([0, 0]), torch.tensor([4, 100]), 3)
    assert value.tolist() == [0.0, 0.0]  # c = 0 -> 0
    value, _ = pass_at_k(torch.tensor([2, 9, 10]), 10, 9)
    assert value.tolist() == [1.0, 1.0, 1.0]  # n − c < k -> 1
    value, _ = pass_at_k(torch.tensor([1]), 10, 9)
    assert value.item() == pytest.approx(closed_form(1, 10, 9))  # n − c = k: 1 − 1/10


def test_per_prompt_sample_counts():
    c, n = torch.tensor([1, 3, 0, 6]), torch.tensor([2, 8, 5, 6])
    value, _ = pass_at_k(c, n, 2)
    assert value.tolist() == pytest.approx([closed_form(int(a), int(b), 2) for a, b in zip(c, n)])


def test_numerically_stable_for_large_n():
    # C(1024, 512) overflows float64; the product form does not.
    value, _ = pass_at_k(torch.tensor([1, 3, 1000]), 1024, 512)
    assert value.tolist() == pytest.approx([closed_form(1, 1024, 512), closed_form(3, 1024, 512), 1.0], abs=1e-9)
    assert torch.isfinite(value).all()


def test_k_above_n_is_nan_and_left_out_of_the_mean():
    value, metrics = pass_at_k(torch.tensor([1, 1]), torch.tensor([2, 8]), 4)
    assert isnan(value[0].item()) and value[1].item() == pytest.approx(closed_form(1, 8, 4))
    assert metrics["pass@k"].item() == pytest.approx(closed_form(1, 8, 4))


def test_invalid_k_and_empty_batch():
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(torch.tensor([1]), 4, 0)
    value, _ = pass_at_k(torch.zeros(0, dtype=torch.long), 8, 2)
    assert value.shape == (0,)


def test_mean_at_k_metrics_detached():
    value, metrics = mean_at_k(torch.tensor([1, 2]), 4)
    assert value.tolist() == [0.25, 0.5] and metrics["mean@k"].item() == pytest.approx(0.375)
    assert not metrics["mean@k"].requires_grad
