"""benchmarks/m2po.py's token mask against a plain-loop reading of the paper's definition: drop the tokens with the
largest squared log-ratio, one at a time, until the mean over the tokens left is <= tau."""

import sys

import pytest
import torch

from support.launching import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from m2po import m2po_mask  # noqa: E402


def reference_mask(log_ratio, mask, tau):
    """The definition as a loop over Python floats."""
    rows, cols = len(log_ratio), len(log_ratio[0])
    tokens = [(log_ratio[b][t] ** 2, b, t) for b in range(rows) for t in range(cols) if mask[b][t]]
    tokens.sort(reverse=True)
    dropped = 0
    while dropped < len(tokens):
        rest = [value for value, _, _ in tokens[dropped:]]
        if sum(rest) / len(rest) <= tau:
            break
        dropped += 1
    keep = [[0.0] * cols for _ in range(rows)]
    for _, b, t in tokens[dropped:]:
        keep[b][t] = 1.0
    return keep


@pytest.mark.parametrize("seed", range(20))
def test_mask_matches_the_loop_on_random_batches_with_padding(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, cols = 1 + seed % 5, 1 + (seed * 7) % 13
    log_ratio = torch.randn(rows, cols, generator=generator, dtype=torch.float64) * (0.05 + 0.1 * (seed % 4))
    mask = (torch.rand(rows, cols, generator=generator) < 0.75).to(torch.float32)  # padding and masked tokens
    log_ratio[mask == 0] = 50.0  # huge values outside the mask must not count
    tau = [0.04, 0.01, 0.001, 1.0][seed % 4]
    got = m2po_mask(log_ratio, mask, tau)
    assert got.dtype == mask.dtype and got.shape == mask.shape
    assert got.tolist() == reference_mask(log_ratio.tolist(), mask.tolist(), tau)
    kept = got.bool()
    if kept.any():
        assert log_ratio[kept].square().mean() <= tau
    assert not (got.bool() & ~mask.bool()).any()


def test_all_below_the_budget_keeps_every_token_and_nothing_masked_when_the_batch_is_empty():
    log_ratio = torch.tensor([[0.1, -0.1, 0.05], [0.0, 0.15, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert m2po_mask(log_ratio, mask, 0.04).tolist() == mask.tolist()
    assert m2po_mask(log_ratio, torch.zeros_like(mask), 0.04).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_the_largest_go_first_and_a_token_alone_over_the_budget_is_dropped_too():
    log_ratio = torch.tensor([[1.0, 0.1, -0.5, 0.0]])
    mask = torch.ones(1, 4)
    # squares 1, 0.01, 0.25, 0: dropping 1 leaves mean 0.0867 > 0.04, dropping 0.25 too leaves 0.005
    assert m2po_mask(log_ratio, mask, 0.04).tolist() == [[0.0, 1.0, 0.0, 1.0]]
    # every token over the budget on its own: none is kept (the batch makes no update)
    assert m2po_mask(torch.full((2, 3), 0.5), torch.ones(2, 3), 0.04).tolist() == [[0.0] * 3] * 2


def test_non_finite_log_ratios_count_as_no_evidence():
    log_ratio = torch.tensor([[float("nan"), 0.1, float("inf")]])
    assert m2po_mask(log_ratio, torch.ones(1, 3), 0.04).tolist() == [[1.0, 1.0, 1.0]]
