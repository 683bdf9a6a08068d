"""Every loss TRL ships, balanced (docs/loss_types.md): each row's fast share and search against its plain-loop
reference, the ratios and token weights against TRL's own formulas, BAPOTrainer's loss against TRL's loss at what the
search reported, a short stale run per loss type and importance-sampling level, and BAPOConfig as a drop-in for every
GRPOConfig option."""

import dataclasses
import inspect
import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trl import GRPOConfig, GRPOTrainer

from bapo_trl import BAPOConfig, BAPOTrainer, search_clip_bounds
from bapo_trl.core.clipping import BAPOSettings, cap_path, search_path
from bapo_trl.core.clipping_reference import (
    cap_loop_search,
    loop_search,
    sapo_contributions,
    sequence_mean_weights,
    sequence_ratios,
    vespo_contributions,
    vespo_sequence_weights,
)
from bapo_trl.core.gates import vespo_log_weights, vespo_weight
from bapo_trl.core.loss_types import LOSS_TYPES, SUPPORTED_LOSS_TYPES, trl_ratios
from bapo_trl.trainer.loss_hook import search_inputs
from support.clipping_batches import adversarial_batches, assert_same_choice, random_batch
from support.trainers import make_trainer, stale_batch

TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
#: CISPO needs its cap set above 1 (TRL reads an unset one as epsilon, 0.2); 1.2 gives the paper's c_high path.
CAP = {"cispo": dict(epsilon_high=1.2)}
VARIANTS = ("paper", "verl")


def test_every_trl_loss_type_has_a_row():
    """The loss types TRL's loss branches on (read from its source) are exactly the table's rows."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    branches = set(re.findall(r'self\.loss_type == "(\w+)"', source))
    for group in re.findall(r"self\.loss_type in \[([^\]]*)\]", source):
        branches |= set(re.findall(r'"(\w+)"', group))
    assert branches == set(TRL_LOSS_TYPES) == set(SUPPORTED_LOSS_TYPES)


# -- the rows' fast searches against the plain loops ------------------------------------------------------------------

def bound_row(name, **values):
    defaults = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                    vespo_k_neg=3.0, vespo_lambda_neg=2.0, ratio_upper_start=1.2, ratio_lower_start=0.6)
    values = {**defaults, **values}
    starts = {name: values.pop(name) for name in ("ratio_upper_start", "ratio_lower_start")}
    return LOSS_TYPES[name].bind(SimpleNamespace(**values, search_path=starts))


def fast_search(row, ratio, advantages, mask, reduce_fn=None, **kw):
    config = BAPOSettings(**kw)
    return search_clip_bounds(ratio, advantages, mask, config=config, sums_fn=row.grid_sums, path=row.path(config),
                              reduce_fn=reduce_fn)


def reference(name, ratio, advantages, mask, gate=None, **kw):
    if name == "cispo":
        return cap_loop_search(ratio, advantages, mask, **kw)
    a_hi, a_lo = kw.get("ratio_upper_start", 1.2), kw.get("ratio_lower_start", 0.6)
    gate = gate or {}
    if name == "sapo":
        fn = sapo_contributions(gate.get("sapo_temperature_pos", 1.0), gate.get("sapo_temperature_neg", 1.05),
                                a_hi, a_lo)
    else:
        fn = vespo_contributions(gate.get("vespo_k_pos", 2.0), gate.get("vespo_lambda_pos", 3.0),
                                 gate.get("vespo_k_neg", 3.0), gate.get("vespo_lambda_neg", 2.0), a_hi, a_lo)
    return loop_search(ratio, advantages, mask, contributions_fn=fn, **kw)


def random_gate(gen, name):
    u = lambda lo, hi: float(torch.rand(1, generator=gen)) * (hi - lo) + lo  # noqa: E731
    if name == "sapo":
        return dict(sapo_temperature_pos=u(0.2, 4.0), sapo_temperature_neg=u(0.2, 4.0))
    if name == "vespo":
        return dict(vespo_k_pos=u(0.0, 4.0), vespo_lambda_pos=u(0.1, 4.0), vespo_k_neg=u(0.0, 4.0),
                    vespo_lambda_neg=u(0.1, 4.0))
    return {}


RANGES = [
    {},
    dict(ratio_lower_start=0.5, ratio_lower_max=0.95, ratio_lower_step=0.07, ratio_upper_start=1.1,
         ratio_upper_max=2.0, ratio_upper_step=0.07),
    dict(ratio_upper_start=1.05, ratio_upper_max=1.33, ratio_upper_step=0.1, ratio_lower_max=0.8,
         ratio_lower_step=0.05),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["cispo", "sapo", "vespo"])
def test_fast_search_matches_the_plain_loop_on_random_batches(name, variant):
    gen = torch.Generator().manual_seed(sum(map(ord, name + variant)))
    stops = set()
    for case in range(150):
        batch, length = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        spread = float(torch.rand(1, generator=gen)) * (4.0 if name == "vespo" else 1.2)
        ratio, adv, mask = random_batch(gen, batch, length, spread, float(torch.randn(1, generator=gen)))
        gate = random_gate(gen, name)
        kw = dict(bapo_variant=variant, positive_contribution_target=float(torch.rand(1, generator=gen)) * 0.9 + 0.05,
                  **RANGES[case % len(RANGES)])
        row = bound_row(name, **gate, ratio_upper_start=kw.get("ratio_upper_start", 1.2),
                        ratio_lower_start=kw.get("ratio_lower_start", 0.6))
        if case % 2:  # aim the target at a random candidate's share, so the search stops along the path
            config = BAPOSettings(**kw)
            path = row.path(config)
            k = int(torch.randint(0, len(path), (1,), generator=gen))
            packed = row.grid_sums(ratio, adv, mask, path)
            H = len(path.high_grid)
            L = H if path.negatives_on_high else len(path.low_grid)
            pos = float(packed[path.high_index[k]])
            neg = float(packed[2 * H + (path.high_index[k] if path.negatives_on_high else path.low_index[k])])
            if pos + neg > 0 and 0.01 < pos / (pos + neg) < 0.99:
                kw["positive_contribution_target"] = pos / (pos + neg) - 1e-7
            assert packed.numel() == 2 * H + 2 * L + 2
        fast = fast_search(row, ratio, adv, mask, **kw)
        stops.add(int(fast.steps))
        assert_same_choice(fast, reference(name, ratio, adv, mask, gate, **kw))
    assert len(stops) >= 6, f"the random cases must stop all along the path, saw {sorted(stops)}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["cispo", "sapo", "vespo"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=adversarial_batches(), target=st.floats(0.01, 0.99))
def test_fast_search_matches_the_plain_loop_on_adversarial_batches(name, variant, data, target):
    ratio, adv, mask = data
    kw = dict(bapo_variant=variant, positive_contribution_target=target)
    assert_same_choice(fast_search(bound_row(name), ratio, adv, mask, **kw), reference(name, ratio, adv, mask, **kw))


@pytest.mark.parametrize("name", ["cispo", "sapo", "vespo"])
def test_one_collective_per_search(name):
    calls = []

    def world_of_two(t):
        calls.append(t.shape)
        return t * 2

    ratio, adv, mask = random_batch(torch.Generator().manual_seed(7), 8, 8, 0.7, -0.3, garbage=False)
    doubled = fast_search(bound_row(name), ratio, adv, mask, reduce_fn=world_of_two).as_floats()
    assert len(calls) == 1
    local = fast_search(bound_row(name), ratio, adv, mask).as_floats()
    assert doubled["clip_high"] == local["clip_high"] and doubled["num_tokens"] == 2 * local["num_tokens"]


@pytest.mark.parametrize("name,extra", [("dapo", {}), ("dapo", dict(delta=3.0, positive_contribution_mode="gradient")),
                                        ("cispo", {}), ("sapo", {}), ("vespo", {})])
def test_the_search_never_reads_a_tensor_back_to_the_host(name, extra, monkeypatch):
    """A stand-in for CUDA's sync check on CPU: every way a tensor reaches Python raises during the search."""
    ratio, adv, mask = random_batch(torch.Generator().manual_seed(9), 6, 7, 0.8, -0.2)
    row = bound_row(name)
    search = lambda *args: fast_search(*args, **extra)  # noqa: E731
    search(row, ratio, adv, mask)  # warm the per-path caches (built once, from Python floats)

    def host_transfer(*args, **kwargs):
        raise AssertionError("host transfer in the search")

    for attr in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, host_transfer)
    result = search(row, ratio, adv, mask)
    monkeypatch.undo()
    assert result.as_floats()["num_tokens"] > 0


def test_cispo_path_is_the_upper_grid_with_no_lower_bound():
    for variant in VARIANTS:
        settings_ = BAPOSettings(bapo_variant=variant, ratio_upper_max=2.02)
        path = cap_path(settings_)
        assert path.clip_low == [0.0] * len(path)
        assert path.clip_high == list(search_path(settings_).high_grid)
    assert cap_path(BAPOSettings()).clip_high[-1] == pytest.approx(3.0) and len(cap_path(BAPOSettings())) == 37
    assert cap_path(BAPOSettings(bapo_variant="verl", ratio_upper_max=2.02)).clip_high[-1] == 2.02
    # TRL's CISPO reads the cap itself, not c - 1
    assert LOSS_TYPES["cispo"].to_trl(0.0, 2.5) == {"epsilon_high": 2.5}
    assert LOSS_TYPES["dapo"].to_trl(0.7, 2.5) == pytest.approx({"epsilon_low": 0.3, "epsilon_high": 1.5})


def test_sapo_share_rises_monotonically_along_the_path():
    """g_tau(r) falls with tau for r != 1: positives' weights rise as tau+ falls, negatives' fall as tau- rises."""
    gen = torch.Generator().manual_seed(11)
    row = bound_row("sapo")
    path = search_path(BAPOSettings())
    for _ in range(50):
        ratio, adv, mask = random_batch(gen, 6, 10, 1.0, float(torch.randn(1, generator=gen)), garbage=False)
        packed = row.grid_sums(ratio, adv, mask, path)
        H, L = len(path.high_grid), len(path.low_grid)
        pos = packed[list(path.high_index)]
        neg = packed[[2 * H + i for i in path.low_index]]
        assert (pos[1:] >= pos[:-1] - 1e-12).all() and (neg[1:] <= neg[:-1] + 1e-12).all()
        assert packed.numel() == 2 * H + 2 * L + 2


def test_search_activity_follows_what_each_row_can_change():
    """``bapo/search_active``: a ratio inside every window of the path changes no clipped loss and no cap, but does
    change a soft gate; a ratio of exactly 1 changes nothing."""
    path, cap = search_path(BAPOSettings()), cap_path(BAPOSettings())
    ratio = torch.full((2, 3), 1.05)
    positive, negative = torch.tensor([[True] * 3, [False] * 3]), torch.tensor([[False] * 3, [True] * 3])
    for name in TRL_LOSS_TYPES:
        row = LOSS_TYPES[name]
        active = row.sensitive(ratio, positive, negative, cap if name == "cispo" else path)
        assert bool(active.any()) == (row.kind == "gate"), name
        assert not row.sensitive(torch.ones(2, 3), positive, negative, path).any()
    assert LOSS_TYPES["cispo"].sensitive(torch.full((2, 3), 1.3), positive, negative, cap).all()  # both signs capped


# -- the ratios and token weights, against TRL's formulas -------------------------------------------------------------

@st.composite
def log_ratio_batches(draw):
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    values = draw(st.lists(st.floats(-25, 25, allow_nan=False), min_size=batch * length, max_size=batch * length))
    mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=batch * length, max_size=batch * length))
    is_ratio = draw(st.none() | st.lists(st.floats(1e-12, 1e9), min_size=batch * length, max_size=batch * length))
    shape = (batch, length)
    return (torch.tensor(values, dtype=torch.float64).view(shape), torch.tensor(mask, dtype=torch.float64).view(shape),
            None if is_ratio is None else torch.tensor(is_ratio, dtype=torch.float64).view(shape))


@settings(max_examples=200, deadline=None)
@given(data=log_ratio_batches())
def test_sequence_ratios_match_trls_gspo_ratio(data):
    log_ratio, mask, _ = data
    assert torch.allclose(trl_ratios(log_ratio, mask, "sequence", {}),
                          torch.tensor(sequence_ratios(log_ratio, mask), dtype=torch.float64), rtol=1e-12)
    assert torch.equal(trl_ratios(log_ratio, mask, "token", {}), torch.exp(log_ratio))


@settings(max_examples=200, deadline=None)
@given(data=log_ratio_batches(), k=st.floats(0, 5), lam=st.floats(0, 5))
def test_vespo_weights_match_trls_gamma_weights(data, k, lam):
    log_ratio, mask, is_ratio = data
    log_w = vespo_log_weights(log_ratio, mask, is_ratio)
    reference_w = torch.tensor(vespo_sequence_weights(log_ratio, mask, is_ratio), dtype=torch.float64)
    assert torch.allclose(torch.exp(log_w).squeeze(1), reference_w, rtol=1e-9)
    advantages = torch.linspace(-1, 1, log_ratio.shape[0], dtype=torch.float64)[:, None]
    phi = GRPOTrainer.get_gamma_weights(advantages, log_ratio, mask, is_ratio, k_pos=k, lambda_pos=lam, k_neg=k,
                                        lambda_neg=lam)
    assert torch.allclose(vespo_weight(log_w, k, lam), phi.double(), rtol=1e-5, atol=1e-30)  # TRL's: float32


def test_search_inputs_weigh_tokens_as_trls_loss_aggregates_them():
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    inputs = {"completion_mask": mask, "advantages": torch.tensor([1.0, -2.0, 0.5]),
              "old_per_token_logps": torch.randn(3, 4, generator=gen),
              "importance_sampling_ratio": torch.rand(3, 4, generator=gen) + 0.5}
    logps = torch.randn(3, 4, generator=gen)
    per_sequence = torch.tensor(sequence_mean_weights(mask))[:, None]
    for name, level in (("grpo", "token"), ("sapo", "sequence"), ("dapo", "token"), ("vespo", "token")):
        row = bound_row(name)
        ratio, adv = search_inputs(row, logps, inputs, level, is_weighted=True)
        base = inputs["advantages"][:, None]
        if name == "vespo":  # IS weights already inside w
            assert torch.allclose(adv.view(3, -1), base)
        else:
            expected = base * inputs["importance_sampling_ratio"]
            expected = expected * per_sequence if name in ("grpo", "sapo") else expected
            assert torch.allclose(adv, expected)
        assert ratio.shape == mask.shape
        log_ratio = logps - inputs["old_per_token_logps"]
        if name == "vespo":  # TRL's sequence weight w, vLLM IS weights included, on every token
            w = vespo_sequence_weights(log_ratio, mask, inputs["importance_sampling_ratio"])
            assert torch.allclose(ratio, torch.tensor(w)[:, None].expand_as(ratio), rtol=1e-5)
        elif level == "sequence":
            assert torch.allclose(ratio, torch.tensor(sequence_ratios(log_ratio, mask)), rtol=1e-5)
        else:
            assert torch.allclose(ratio, log_ratio.exp())


# -- delta below ratio_upper_max: the upper path ends at delta --------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_delta_below_the_upper_max_ends_the_upper_path(variant):
    with pytest.warns(UserWarning, match=r"`delta` \(2.03\) is below `ratio_upper_max` \(3.0\)"):
        config = BAPOConfig(output_dir="unused", use_cpu=True, delta=2.03, bapo_variant=variant,
                            steps_per_generation=2)
    assert config.bapo_settings.ratio_upper_max == 2.03 and config.search_path["ratio_upper_max"] == 3.0
    path = search_path(config.bapo_settings)
    assert max(path.clip_high) <= 2.03
    assert path.clip_high[-1] == (2.03 if variant == "verl" else pytest.approx(2.0))
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):  # the lattice / last-point logic holds with an off-lattice end
        ratio, adv, mask = random_batch(gen, 5, 8, 1.0, float(torch.randn(1, generator=gen)))
        kw = dataclasses.asdict(config.bapo_settings)
        assert_same_choice(search_clip_bounds(ratio, adv, mask, config=config.bapo_settings),
                           loop_search(ratio, adv, mask, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        BAPOConfig(output_dir="unused", use_cpu=True, delta=3.0, steps_per_generation=2)  # the full path, no warning


def test_delta_below_the_upper_start_is_refused():
    with pytest.raises(ValueError, match=re.escape("`delta` (1.1) must be >= `ratio_upper_start` (1.2)")):
        BAPOConfig(output_dir="unused", use_cpu=True, delta=1.1)


# -- configuration: every loss type and level accepted; what is refused says what to do -------------------------------

@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_every_loss_type_and_level_is_accepted(loss_type, level):
    config = BAPOConfig(output_dir="unused", use_cpu=True, loss_type=loss_type, importance_sampling_level=level,
                        **CAP.get(loss_type, {}))
    assert config.loss_type == loss_type and config.importance_sampling_level == level


@pytest.mark.parametrize("overrides,fragments", [
    (dict(loss_type="ppo"), ["`loss_type` must be one of", "'cispo'", "'vespo'", "got 'ppo'"]),
    (dict(importance_sampling_level="group"), ["`importance_sampling_level` must be one of ('token', 'sequence')",
                                               "got 'group'"]),
    (dict(loss_type="sapo", ratio_upper_start=1.0), ["`ratio_upper_start` must be > 1 with loss_type='sapo'",
                                                    "got 1.0", "use e.g. 1.2"]),
    (dict(loss_type="vespo", ratio_lower_start=0.9, ratio_lower_max=1.0),
     ["`ratio_lower_max` must be < 1 with loss_type='vespo'", "got 1.0"]),
    (dict(loss_type="sapo", sapo_temperature_pos=0.0), ["`sapo_temperature_pos` must be a finite number > 0", "0.0"]),
    (dict(use_liger_kernel=True), ["`use_liger_kernel` must be False", "set use_liger_kernel=False"]),
])
def test_what_bapo_cannot_honour_is_refused_with_what_to_do(overrides, fragments):
    with pytest.raises(ValueError) as err:
        BAPOConfig(output_dir="unused", use_cpu=True, **overrides)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("overrides,fragment", [
    (dict(loss_type="cispo", epsilon_high=5.0, ratio_lower_max=0.8), "have no effect with loss_type='cispo'"),
    (dict(loss_type="sapo", delta=4.0), "`delta` (4.0) has no effect with loss_type='sapo'"),
    (dict(loss_type="vespo", positive_contribution_mode="gradient"), "the value and the gradient share are one"),
    (dict(loss_type="vespo", positive_contribution_is_weighted=True), "folds the vLLM importance-sampling"),
])
def test_useless_settings_of_a_loss_type_warn(overrides, fragment):
    with pytest.warns(UserWarning) as record:
        BAPOConfig(output_dir="unused", use_cpu=True, **overrides)
    assert any(fragment in str(w.message) for w in record), [str(w.message) for w in record]


def test_the_dual_clip_only_where_trl_reads_delta():
    for variant in ("paper", "verl"):
        assert BAPOConfig(output_dir="unused", use_cpu=True, bapo_variant=variant,
                          loss_type="luspo").effective_delta == 3.0
        for loss_type in ("cispo", "sapo", "vespo"):
            assert BAPOConfig(output_dir="unused", use_cpu=True, bapo_variant=variant,
                              loss_type=loss_type, **CAP.get(loss_type, {})).effective_delta is None


def test_delta_reaches_the_search_settings_of_the_clipped_losses_only():
    def settings(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return BAPOConfig(output_dir="unused", use_cpu=True, **kw).bapo_settings

    assert (settings().delta == 3.0 and settings(bapo_variant="verl").delta == 3.0
            and settings(dual_clip=False).delta is None)
    assert settings(delta=4.0).delta == 4.0 and settings(delta=4.0).ratio_upper_max == 3.0
    assert (settings(delta=2.03).delta, settings(delta=2.03).ratio_upper_max) == (2.03, 2.03)
    for loss_type in ("cispo", "sapo", "vespo"):  # TRL reads delta in the clipped losses only
        assert settings(loss_type=loss_type, delta=4.0, **CAP.get(loss_type, {})).delta is None


GRADIENT_CASES = [  # (loss_type, importance_sampling_level, settings): TRL's two-sided clip on
    ("dapo", "token", dict(bapo_variant="verl")), ("grpo", "token", dict(delta=2.5)),
    ("bnpo", "sequence", dict(delta=3.0)),
]


@pytest.mark.parametrize("loss_type,level,extra", GRADIENT_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'-'.join(c[2])}" for c in GRADIENT_CASES])
def test_gradient_share_is_the_share_of_the_gradient_trls_loss_carries(tiny_model_dir, tmp_path, monkeypatch,
                                                                       loss_type, level, extra):
    """positive_contribution_mode="gradient" with `delta`: the tokens of TRL's loss with a nonzero gradient w.r.t.
    their log-prob are exactly the ones the share counts (positives below c_high; negatives above c_low and not above
    delta, where TRL's clamp leaves the loss -delta A), and the share of that gradient's size by sign is the share
    the search reports (each such gradient is r |A| times the token's weight in the loss)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, loss_type=loss_type,
                            importance_sampling_level=level, positive_contribution_mode="gradient", **extra)
    delta = bapo.args.effective_delta
    assert delta is not None and bapo.args.bapo_settings.delta == delta
    forwards = []
    policy_forward = bapo._get_per_token_logps_and_entropies

    def keep_logps(*args, **kwargs):
        logps, entropies, aux = policy_forward(*args, **kwargs)
        logps.retain_grad()
        forwards.append(logps)
        return logps, entropies, aux

    monkeypatch.setattr(bapo, "_get_per_token_logps_and_entropies", keep_logps)
    above_delta = 0
    for seed in range(4):
        batch = stale_batch(bapo, seed, noise=0.9, adv_shift=0.2 * seed - 0.4)
        lift = torch.zeros(4, 6)  # behaviour log-probs lowered: ratios far above 1, many above delta
        if level == "token":
            lift[:, :2] = 1.6  # the first two tokens of every row
        else:
            lift[1], lift[3] = 2.0, 0.3  # two rows of negative advantage: one above delta, one below
        batch["old_per_token_logps"] = batch["old_per_token_logps"] - lift
        forwards.clear()
        bapo.model.zero_grad()
        bapo.compute_loss(bapo.model, dict(batch)).backward()
        chosen = bapo.last_search.as_floats()
        logps = forwards[0]
        mask = batch["completion_mask"] != 0
        ratio = trl_ratios(logps.detach() - batch["old_per_token_logps"], mask.float(), level, batch)
        adv = batch["advantages"][:, None].expand_as(ratio)
        carried = (logps.grad != 0) & mask
        positive, negative = mask & (adv > 0), mask & (adv < 0)
        assert torch.equal(carried & positive, positive & (ratio < chosen["clip_high"]))
        assert torch.equal(carried & negative, negative & (ratio > chosen["clip_low"]) & (ratio <= delta))
        size = logps.grad.abs().double()
        pos, neg = size[positive].sum(), size[negative].sum()
        assert chosen["gradient_share"] == pytest.approx(float(pos / (pos + neg)), rel=1e-5)
        assert chosen["positive_contribution"] == chosen["gradient_share"]
        above_delta += int((negative & (ratio > delta)).sum())
    assert above_delta, "the scripted batches must hold negative tokens above delta"

#: GRPOConfig fields whose non-default value the walk below cannot pick from the type and default alone:
#: value (and the companion settings GRPOConfig itself needs for it).
VALUES = dict(
    output_dir=("other-dir",), per_device_train_batch_size=(16,), length_column_name=("n_tokens",),
    lr_scheduler_type=("cosine",), lr_scheduler_kwargs=({"num_cycles": 2},), optim=("adamw_torch",),
    optim_args=("foo=1",), optim_target_modules=(["q_proj"],), bf16=(False,), tf32=(False,),
    activation_checkpointing=(False,), activation_checkpointing_kwargs=({"use_reentrant": False},),
    gradient_checkpointing_kwargs=({"use_reentrant": False},), torch_compile_backend=("eager",),
    torch_compile_mode=("default",), liger_kernel_config=({"rope": True},), neftune_noise_alpha=(5.0,),
    torch_empty_cache_steps=(10,), logging_strategy=("epoch",), include_num_input_tokens_seen=("all",),
    disable_tqdm=(True,), report_to=("tensorboard",), run_name=("run",), project=("p",),
    trackio_space_id=("me/space",), trackio_bucket_id=("bucket",), trackio_static_space_id=("me/static",),
    eval_strategy=("steps",), eval_steps=(10,), eval_accumulation_steps=(2,), include_for_metrics=(["inputs"],),
    save_strategy=("epoch",), save_total_limit=(2,), hub_token=("x",), hub_private_repo=(True,),
    hub_model_id=("me/model",), hub_strategy=("end",), hub_revision=("main",),
    load_best_model_at_end=(True, dict(eval_strategy="steps", eval_steps=500)), metric_for_best_model=("loss",),
    greater_is_better=(True,), data_seed=(1,), accelerator_config=({"split_batches": True},),
    dataloader_prefetch_factor=(2, dict(dataloader_num_workers=1)), label_names=(["labels"],),
    ddp_find_unused_parameters=(False,), ddp_bucket_cap_mb=(25,), ddp_broadcast_buffers=(False,),
    ddp_static_graph=(True,), ddp_backend=("gloo",), fsdp=("full_shard",), fsdp_config=({"min_num_params": 0},),
    deepspeed=({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}},),
    debug=("underflow_overflow",), resume_from_checkpoint=("some/checkpoint",),
    model_init_kwargs=({"dtype": "float32"},), router_aux_loss_coef=(0.01,), num_generations=(4,),
    num_generations_eval=(4,), pad_to_multiple_of=(8,), generation_batch_size=(16,), steps_per_generation=(2,),
    min_p=(0.1,), generation_kwargs=({"max_new_tokens": 4},), chat_template_kwargs=({"enable_thinking": False},),
    cache_implementation=("static",), vllm_mode=("server",), vllm_model_impl=("transformers",),
    vllm_structured_outputs_regex=("a+",), vllm_server_base_url=("http://localhost:8000",),
    vllm_server_host=("127.0.0.1",), vllm_max_model_length=(512,), delta=(4.0,), epsilon_high=(0.28,),
    importance_sampling_level=("sequence",), reward_weights=([1.0],),
    multi_objective_aggregation=("normalize_then_sum",), scale_rewards=("batch",),
    loss_type=("cispo", dict(epsilon_high=5.0)),
    max_tool_calling_iterations=(3,), vllm_importance_sampling_mode=("token_truncate",),
    vllm_importance_sampling_clip_min=(0.5,), vllm_importance_sampling_cap=(2.0,), off_policy_mask_threshold=(0.5,),
    num_completions_to_print=(2,), log_completions_hub_repo=("me/x", dict(log_completions=True)),
    transformers_continuous_batching_config=({"max_memory_percent": 0.3},),
)
#: Options BAPO refuses, each for a reason its message gives (checked below).
REFUSED = {"use_liger_kernel"}
#: Options GRPOConfig itself refuses in a single CPU process (nothing for BAPO to accept).
TRL_REFUSES = {"auto_find_batch_size", "ddp_backend"}


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _other_value(f):
    """A non-default value of a field, from its table entry or its default's type (choices, bool, number)."""
    if f.name == "parallelism_config":
        from accelerate.parallelism_config import ParallelismConfig

        return ParallelismConfig(dp_shard_size=1), {}
    if f.name in VALUES:
        value, *extra = VALUES[f.name]
        return value, (extra[0] if extra else {})
    default = _default(f)
    for choice in f.metadata.get("choices") or ():
        if choice != default:
            return choice, {}
    if isinstance(default, bool):
        return not default, {}
    if isinstance(default, int):
        return default + 1, {}
    if isinstance(default, float):
        return default * 0.5 if default else 0.5, {}
    raise AssertionError(f"GRPOConfig field `{f.name}` (default {default!r}) has no value in the walk: add one to "
                         "VALUES in tests/test_loss_types.py, then decide whether BAPO accepts it")


def test_every_grpo_option_is_accepted_or_refused_with_a_reason(tmp_path):
    """Drop-in: each GRPOConfig field, set to a non-default value, is either accepted by BAPOConfig (with the value
    GRPOConfig makes of it) or refused with a message naming the field and what to do."""
    fields = [f for f in dataclasses.fields(GRPOConfig) if f.init]
    assert len(fields) > 150
    accepted, refused = [], []
    for f in fields:
        value, extra = _other_value(f)
        assert value != _default(f), f.name
        kwargs = {"output_dir": str(tmp_path), "use_cpu": True, **extra, f.name: value}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if f.name in TRL_REFUSES:
                for cls in (GRPOConfig, BAPOConfig):
                    with pytest.raises((ValueError, TypeError)):
                        cls(**kwargs)
                continue
            grpo = GRPOConfig(**kwargs)
            try:
                bapo = BAPOConfig(**kwargs)
            except ValueError as err:
                assert f"`{f.name}`" in str(err) and f.name in REFUSED, (f.name, str(err))
                refused.append(f.name)
                continue
        assert getattr(bapo, f.name) == getattr(grpo, f.name), f.name
        accepted.append(f.name)
    assert set(refused) == REFUSED
    assert len(accepted) == len(fields) - len(REFUSED) - len(TRL_REFUSES)


# -- BAPOTrainer: TRL's loss at what the search reported --------------------------------------------------------------

CASES = [  # (loss_type, importance_sampling_level, extra settings)
    # CISPO's cap is epsilon_high; 1.2 gives the paper's c_high path, 1.2..3.0
    ("cispo", "token", dict(epsilon_high=1.2)), ("cispo", "sequence", dict(epsilon_high=1.2)),
    ("sapo", "token", {}), ("sapo", "sequence", {}),
    ("vespo", "token", {}), ("luspo", "sequence", {}), ("luspo", "token", {}), ("grpo", "sequence", {}),
    ("grpo", "token", {}), ("dapo", "sequence", {}), ("bnpo", "sequence", {}), ("dapo", "token", dict(delta=2.0)),
    ("sapo", "token", dict(bapo_variant="verl")), ("cispo", "token", dict(bapo_variant="verl", epsilon_high=1.2)),
]


def trl_settings(trainer, chosen: dict) -> dict:
    """The GRPOConfig settings that give TRL's loss what BAPO installed."""
    values = trainer.loss.to_trl(chosen["clip_low"], chosen["clip_high"])
    if trainer.args.loss_type == "cispo":
        return {"epsilon_high": values["epsilon_high"]}
    if "epsilon_low" in values:
        return {"epsilon": values["epsilon_low"], "epsilon_high": values["epsilon_high"]}
    return {name[len("args."):]: value for name, value in values.items()}


@pytest.mark.parametrize("loss_type,level,extra", CASES, ids=[f"{c[0]}-{c[1]}-{'-'.join(c[2]) or 'default'}"
                                                              for c in CASES])
def test_loss_equals_trls_loss_at_the_reported_window(tiny_model_dir, tmp_path, loss_type, level, extra):
    kw = dict(loss_type=loss_type, importance_sampling_level=level, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / "b", **kw)
    start = {name: getattr(bapo.args, name) for name in bapo.loss.reads}
    moved = 0
    for seed in range(5):
        batch = stale_batch(bapo, seed, noise=0.9, adv_shift=0.15 * seed - 0.3)
        loss_b = bapo.compute_loss(bapo.model, dict(batch))
        chosen = bapo.last_search.as_floats()
        moved += 0 < chosen["steps"]
        grpo = make_trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / f"g{seed}",
                            **{k: v for k, v in kw.items() if k not in ("bapo_variant", "delta", "epsilon_high")},
                            # the dual clip: TRL's delta
                            delta=bapo.args.effective_delta, **trl_settings(bapo, chosen))
        loss_g = grpo.compute_loss(grpo.model, dict(batch))
        assert torch.allclose(loss_b, loss_g, atol=1e-6), (seed, loss_b, loss_g, chosen)
        assert {name: getattr(bapo.args, name) for name in bapo.loss.reads} == start  # the gate's start, restored
    assert moved, "the scripted stale batches must make the search move"
    if loss_type == "cispo" and level == "token":  # the clip flags are what TRL counts as clipped
        assert bapo._metrics["train"]["bapo/clip_fraction_high"] == pytest.approx(
            bapo._metrics["train"]["cispo_clip_ratio"])
        assert set(bapo._metrics["train"]["bapo/clip_low"]) == {0.0}  # CISPO has no lower bound


def test_the_gradient_equals_trls_at_the_reported_gate(tiny_model_dir, tmp_path):
    bapo = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path / "b", loss_type="sapo")
    batch = stale_batch(bapo, 1, noise=0.9)
    bapo.compute_loss(bapo.model, dict(batch)).backward()
    grpo = make_trainer(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "g", loss_type="sapo",
                        **trl_settings(bapo, bapo.last_search.as_floats()))
    grpo.compute_loss(grpo.model, dict(batch)).backward()
    for (name, pb), (_, pg) in zip(bapo.model.named_parameters(), grpo.model.named_parameters()):
        assert torch.allclose(pb.grad, pg.grad, atol=1e-6), name


# -- every loss type and level through a short stale run --------------------------------------------------------------

#: Sequence ratios (the mean log-ratio of a completion) stay close to 1 in 4 short updates: CISPO's cap, which acts on
#: ratios above it only, gets a path that starts near 1 (``bapo/search_active`` is 0 otherwise: nothing to adapt).
WALK_EXTRA = {("cispo", "sequence"): dict(ratio_upper_start=1.01, ratio_upper_step=0.01, ratio_upper_max=1.5)}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_short_stale_run_moves_the_window_and_logs_finite_metrics(tiny_model_dir, tmp_path, loss_type, level):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer = make_trainer(BAPOTrainer, BAPOConfig, tiny_model_dir, tmp_path, loss_type=loss_type,
                               importance_sampling_level=level, steps_per_generation=4, max_steps=4,
                               learning_rate=5e-3, temperature=1.0, disable_tqdm=True,
                               positive_contribution_target=0.6, **CAP.get(loss_type, {}),
                               **WALK_EXTRA.get((loss_type, level), {}))
    start = {name: getattr(trainer.args, name) for name in trainer.loss.reads}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    path = trainer.loss.path(trainer.args.bapo_settings)
    moved = [h for h in logs if (h["bapo/clip_low"], h["bapo/clip_high"]) != (path.clip_low[0], path.clip_high[0])]
    assert moved, [(h["bapo/clip_low"], h["bapo/clip_high"]) for h in logs]
    for h in logs:
        for name, value in h.items():
            if name.startswith(("bapo/", "entropy_clip/")) and value is not None:
                assert math.isfinite(value), (name, value)
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"])
    gates = [f"bapo/{name}" for name in trainer.loss.reads]
    if gates:  # the gate's parameters are logged, and moved with the window
        assert all(name in h for h in logs for name in gates)
        assert any(h[name] != start[name[len("bapo/"):]] for h in moved for name in gates)
    assert {name: getattr(trainer.args, name) for name in trainer.loss.reads} == start
