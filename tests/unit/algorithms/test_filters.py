"""DAPO filters: dynamic-sampling group selection and the soft overlong penalty."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.filters import groups_with_signal, overlong_penalty

T_ = True
F_ = False


def test_groups_with_signal() -> None:
    # group 4: valid 1, 1 (the invalid 7 is ignored) -> no signal; group 1: 0, 1 -> signal;
    # group 2: 2, 2 -> none; group 3: singleton -> none
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 5.0, 7.0])
    groups = torch.tensor([4, 1, 4, 1, 2, 2, 3, 4])
    valid = torch.tensor([T_, T_, T_, T_, T_, T_, T_, F_])
    expected = torch.tensor([F_, T_, F_, T_, F_, F_, F_, F_])
    assert torch.equal(groups_with_signal(rewards, groups, valid), expected)
    # without `valid` the 7 counts, and group 4 has signal
    expected_all = torch.tensor([T_, T_, T_, T_, F_, F_, F_, T_])
    assert torch.equal(groups_with_signal(rewards, groups), expected_all)


def test_groups_with_signal_invalid_row_takes_its_groups_answer() -> None:
    rewards = torch.tensor([0.0, 1.0, float("nan"), 3.0])
    groups = torch.tensor([0, 0, 0, 1])
    valid = torch.tensor([T_, T_, F_, F_])
    assert torch.equal(groups_with_signal(rewards, groups, valid), torch.tensor([T_, T_, T_, F_]))


def test_overlong_penalty() -> None:
    lengths = torch.tensor([10, 15, 16, 18, 20, 21, 100])
    expected = torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer=5), expected)
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer=5, penalty=0.5), expected * 0.5)
    hard = overlong_penalty(torch.tensor([20, 21]), max_len=20, buffer=0)
    torch.testing.assert_close(hard, torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len=20, buffer=21)
