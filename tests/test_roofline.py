"""The roofline bound of each phase (lit_rlvr.functional.roofline) on hand-worked numbers."""

import pytest
import torch

from lit_rlvr.functional.flops import generation_bytes, generation_flops
from lit_rlvr.functional.roofline import decode_roofline, roofline_seconds

# L = 1, d = 2, I = 3, H = K = 1, e = 2, V = 5: W = 2·2·1·2 + 2·2·1·2 + 3·2·3 = 34 multiply-adds per position,
# 2·W + 2·d·V = 88 FLOPs per decoding row and step, attention 4·L·H·e = 8 FLOPs per cached position read
SHAPE = dict(layers=1, hidden=2, intermediate=3, heads=1, kv_heads=1, head_dim=2, vocab=5)
WEIGHTS = dict(parameters=100, dtype_bytes=4)  # P·b = 400 bytes; κ = 2·1·1·2·4 = 16 bytes per position


def test_bound_is_the_larger_of_compute_and_memory():
    assert roofline_seconds(300.0, 40.0, peak_flops=100.0, peak_bandwidth=20.0) == pytest.approx(3.0)
    assert roofline_seconds(300.0, 80.0, peak_flops=100.0, peak_bandwidth=20.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="peak_flops"):
        roofline_seconds(1.0, 1.0, peak_flops=0.0, peak_bandwidth=1.0)


def test_one_row_steps_switch_between_bounds():
    # prompt 2, response 3: steps j = 1, 2 see 3 and 4 positions.
    # F_1 = 88 + 8·3 = 112, F_2 = 88 + 8·4 = 120; B_1 = 400 + 16·3 = 448, B_2 = 400 + 16·4 = 464.
    # Π = 1, β = 4: step 1 max(112, 112) = 112, step 2 max(120, 116) = 120 (compute) -> 232
    seconds, terms = decode_roofline(torch.tensor([2]), torch.tensor([3]), peak_flops=1.0, peak_bandwidth=4.0,
                                     **WEIGHTS, **SHAPE)
    assert seconds == pytest.approx(232.0)
    assert terms["flops"] == pytest.approx(232.0) and terms["bytes"] == pytest.approx(912.0)
    assert terms["compute_s"] == pytest.approx(232.0) and terms["memory_s"] == pytest.approx(228.0)
    assert terms["steps"] == 2 and terms["memory_bound_steps"] == 0
    # Π = 100: every step memory-bound, 448/4 + 464/4 = 228
    seconds, terms = decode_roofline(torch.tensor([2]), torch.tensor([3]), peak_flops=100.0, peak_bandwidth=4.0,
                                     **WEIGHTS, **SHAPE)
    assert seconds == pytest.approx(228.0) and terms["memory_bound_steps"] == 2


def test_rows_leave_the_batch_when_they_end():
    # prompts 2 and 1, responses 3 and 2: step 1 both rows (3 + 2 positions), step 2 the first (4).
    # F_1 = 2·88 + 8·5 = 216, F_2 = 88 + 8·4 = 120; B_1 = 400 + 16·5 = 480, B_2 = 400 + 16·4 = 464
    prompt, response = torch.tensor([2, 1]), torch.tensor([3, 2])
    seconds, terms = decode_roofline(prompt, response, peak_flops=10.0, peak_bandwidth=4.0, **WEIGHTS, **SHAPE)
    assert seconds == pytest.approx(120.0 + 116.0)  # both steps memory-bound: 480/4, 464/4
    assert terms["flops"] == pytest.approx(336.0) and terms["memory_bound_steps"] == 2
    # the same FLOPs as generation_flops' decode term, the same KV reads as generation_bytes
    _, parts = generation_flops(prompt, prompt, response, **SHAPE)
    assert terms["flops"] == pytest.approx(float(parts["decode"]))
    _, moved = generation_bytes(prompt, prompt, response, torch.zeros(2), **WEIGHTS,
                                layers=1, kv_heads=1, head_dim=2)
    assert terms["bytes"] - 2 * 400 == pytest.approx(float(moved["kv_read"]))


def test_no_decode_steps_cost_nothing():
    seconds, terms = decode_roofline(torch.tensor([4, 4]), torch.tensor([1, 1]), peak_flops=1.0, peak_bandwidth=1.0,
                                     **WEIGHTS, **SHAPE)
    assert seconds == 0.0 and terms["steps"] == 0
