"""The replay queue on its own: capacity, eviction by age, sampling modes, padding, state round trip."""

import pytest
import torch

from bapo_trl.rollout.replay_queue import ReplayQueue, groups_to_replace, pad_and_stack, split_groups


def group(version, advantages=(1.0, -1.0), prompt_len=3, completion_len=4, fill=None):
    rows = len(advantages)
    value = version if fill is None else fill
    completion_mask = torch.ones(rows, completion_len)
    completion_mask[0, completion_len - 1 :] = 0  # right padding on one row
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompt_mask[:, 0] = 0  # a shared pad column on the left, compacted away when stored
    return {
        "prompt_ids": torch.full((rows, prompt_len), value, dtype=torch.long),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.full((rows, completion_len), value, dtype=torch.long),
        "completion_mask": completion_mask,
        "old_per_token_logps": torch.full((rows, completion_len), -float(value)),
        "advantages": torch.tensor(advantages),
        "policy_version": torch.full((rows,), version, dtype=torch.long),
    }


def test_capacity_evicts_oldest_first():
    q = ReplayQueue(capacity=3, max_staleness=100)
    for v in range(5):
        assert q.push(group(v))
    assert len(q) == 3
    assert sorted(int(g["policy_version"][0]) for g in q.groups) == [2, 3, 4]
    assert q.pop_stats()["evicted_capacity"] == 2


def test_groups_without_signal_are_not_stored():
    q = ReplayQueue(capacity=3, max_staleness=10)
    assert not q.push(group(0, advantages=(0.0, 0.0)))
    assert len(q) == 0


def test_eviction_by_age_and_never_sampled_when_stale():
    q = ReplayQueue(capacity=10, max_staleness=4)
    for v in range(6):
        q.push(group(v))
    sampled = q.sample(10, current_step=8)  # ages 8..3: only versions 4, 5 are within 4 steps
    assert sorted(int(g["policy_version"][0]) for g in sampled) == [4, 5]
    assert len(q) == 2 and q.pop_stats()["evicted_age"] == 4


def test_sampling_is_without_replacement_and_groups_stay_for_later():
    q = ReplayQueue(capacity=10, max_staleness=100, seed=1)
    for v in range(6):
        q.push(group(v))
    first = q.sample(4, current_step=6)
    assert len({int(g["policy_version"][0]) for g in first}) == 4
    assert len(q) == 6  # replayed groups may be replayed again until they age out


def test_recent_sampling_takes_the_newest():
    q = ReplayQueue(capacity=10, max_staleness=100, sampling="recent")
    for v in range(6):
        q.push(group(v))
    assert sorted(int(g["policy_version"][0]) for g in q.sample(2, current_step=6)) == [4, 5]


def test_advantage_sampling_prefers_informative_groups():
    q = ReplayQueue(capacity=10, max_staleness=100, sampling="advantage", seed=0)
    q.push(group(0, advantages=(0.01, -0.01)))  # almost no spread
    q.push(group(1, advantages=(2.0, -2.0)))  # large spread
    picks = [int(q.sample(1, current_step=2)[0]["policy_version"][0]) for _ in range(200)]
    assert picks.count(1) > 190


def test_uniform_sampling_covers_everything():
    q = ReplayQueue(capacity=10, max_staleness=100, sampling="uniform", seed=0)
    for v in range(4):
        q.push(group(v))
    picks = [int(q.sample(1, current_step=4)[0]["policy_version"][0]) for _ in range(400)]
    assert all(60 < picks.count(v) < 140 for v in range(4))


def test_stored_groups_drop_shared_padding_and_pad_back_when_stacked():
    q = ReplayQueue(capacity=4, max_staleness=100)
    q.push(group(1, prompt_len=5, completion_len=7))
    stored = q.groups[0]
    assert stored["prompt_ids"].shape == (2, 4) and stored["completion_ids"].shape == (2, 7)
    fresh = group(2, prompt_len=3, completion_len=9)
    mixed = pad_and_stack([fresh, stored], {"prompt_ids": 0, "completion_ids": 0})
    assert mixed["prompt_ids"].shape == (4, 4) and mixed["completion_ids"].shape == (4, 9)
    # prompts padded on the left, completions on the right, masks padded with zeros
    assert mixed["prompt_mask"][0, 0] == 0 and mixed["prompt_ids"][0, 0] == 0
    assert torch.equal(mixed["completion_mask"][2:, 7:], torch.zeros(2, 2))
    assert torch.equal(mixed["old_per_token_logps"][2:, :7], stored["old_per_token_logps"])


def test_state_round_trip_continues_identically(tmp_path):
    a = ReplayQueue(capacity=5, max_staleness=6, sampling="advantage", seed=3)
    for v in range(7):
        a.push(group(v, advantages=(float(v % 3) + 0.5, -1.0)))
    a.sample(2, current_step=7)
    torch.save(a.state_dict(), tmp_path / "q.pt")
    b = ReplayQueue(capacity=5, max_staleness=6, sampling="advantage", seed=999)
    b.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=False))
    for step in range(8, 12):
        ga, gb = a.sample(2, current_step=step), b.sample(2, current_step=step)
        assert [int(g["policy_version"][0]) for g in ga] == [int(g["policy_version"][0]) for g in gb]
    assert a.stats.totals == b.stats.totals


def test_resume_with_changed_settings_applies_the_current_ones_and_says_so():
    a = ReplayQueue(capacity=5, max_staleness=6, sampling="uniform", seed=3)
    for v in range(5):
        a.push(group(v))
    b = ReplayQueue(capacity=2, max_staleness=9, sampling="uniform", seed=3)
    with pytest.warns(UserWarning, match=r"replay_buffer_size: 5 in the checkpoint -> 2 now; "
                                         r"replay_max_staleness: 6 in the checkpoint -> 9 now"):
        b.load_state_dict(a.state_dict())
    assert [int(g["policy_version"][0]) for g in b.groups] == [3, 4]  # trimmed to the new capacity, oldest out
    assert (b.capacity, b.max_staleness) == (2, 9)


def test_split_and_replace_helpers():
    batch = {"advantages": torch.arange(8.0), "x": torch.arange(16).view(8, 2)}
    groups = split_groups(batch, 4)
    assert len(groups) == 2 and torch.equal(groups[1]["x"], torch.arange(8, 16).view(4, 2))
    with pytest.raises(ValueError, match="whole groups"):
        split_groups(batch, 3)
    gen = torch.Generator().manual_seed(0)
    assert groups_to_replace([True, False, True, False], 2, True, gen) == [1, 3]
    assert len(groups_to_replace([True] * 5, 3, False, gen)) == 3


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="replay_buffer_size"):
        ReplayQueue(0, 4)
    with pytest.raises(ValueError, match="replay_max_staleness"):
        ReplayQueue(4, 0)
    with pytest.raises(ValueError, match="replay_sampling"):
        ReplayQueue(4, 4, sampling="oldest")
