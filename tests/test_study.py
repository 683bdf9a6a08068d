"""The studies' shared statistics (benchmarks/study.py) and the evidence study's report, on synthetic runs: a
claim is made only where the paired interval excludes zero, from enough seeds."""

import gzip
import json
import statistics
import sys

import pytest

from support.launching import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import evidence_study  # noqa: E402
from study import (  # noqa: E402
    BAPO_ONLY,
    STALENESS,
    bootstrap_ci,
    false_verdict_rate,
    paired,
    parse_seeds,
    read_jsonl,
    seed_tag,
    verdict,
)


def test_seed_ranges():
    assert parse_seeds("100-119") == list(range(100, 120)) and parse_seeds("3") == [0, 1, 2]
    assert parse_seeds(" 5,7 ") == [5, 7] and seed_tag("200-219") == "_seeds200-219" and seed_tag(None) == ""
    for bad in ("", "x", "5-3", "-2", "0"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)
    assert parse_seeds("100-100", count=False) == [100]
    with pytest.raises(ValueError, match="one seed: 100-100"):  # a bare 100 is not seeds 0-99 there
        parse_seeds("100", count=False)


def test_a_tie_reads_as_a_verdict_more_often_at_fewer_seeds():
    """The rate the SmolLM2 reports quote: a percentile interval over a few paired seeds excludes zero for a true tie
    far more often than 5% (about 1 in 5 at 4 seeds), and less often with more seeds."""
    few, many = false_verdict_rate(4, trials=400), false_verdict_rate(20, trials=400)
    assert 0.12 < few < 0.3 and many < few and 0.0 < many < 0.12
    assert false_verdict_rate(4, trials=400) == few  # seeded


def test_bootstrap_interval_is_fixed_by_its_seed_and_holds_the_mean():
    diffs = [0.3, -0.1, 0.2, 0.05, 0.4, -0.2, 0.1, 0.15, 0.0, 0.25]
    low, high = bootstrap_ci(diffs)
    assert (low, high) == bootstrap_ci(diffs) and low < statistics.mean(diffs) < high
    assert bootstrap_ci([0.2] * 12) == pytest.approx((0.2, 0.2))
    wide = bootstrap_ci([(-1) ** i * 0.3 for i in range(20)])  # mean 0: the interval holds it
    assert wide[0] < 0 < wide[1]


def test_verdict_only_when_the_interval_excludes_zero():
    assert verdict(0.01, 0.2) == "beats" and verdict(-0.3, -0.01) == "loses" and verdict(-0.1, 0.1) == "ties"
    assert verdict(0.0, 0.1) == "ties" and verdict(float("nan"), 1.0) == "n/a"
    assert verdict(0.1, 0.2, ("larger", "smaller", "no difference")) == "larger"


def test_paired_uses_only_the_seeds_both_methods_ran():
    values = {"a": {1: 0.9, 2: 0.8, 3: 0.7}, "b": {2: 0.5, 3: 0.6, 4: 0.1}}
    c = paired(values, "a", "b")
    assert c["n"] == 2 and c["diff"] == pytest.approx(0.2)


def record(method, staleness, lr, seed, reward, grad=5.0, entropy=0.5):
    return dict(method=method, staleness=staleness, lr=lr, seed=seed, steps=160, trainer="bapo", settings={},
                commit="abc", seconds=10.0, reward_final=reward, collapsed=int(reward < 0.1), grad_norm_max=grad,
                entropy_final=entropy)


def test_report_claims_a_difference_only_where_the_interval_excludes_zero():
    runs = []
    for seed in range(100, 112):
        base = 0.5 + 0.02 * (seed % 5)
        runs += [record("TRL dapo clip-higher", "spg 32", 1e-3, seed, base, grad=150.0),
                 record("BAPO paper", "spg 32", 1e-3, seed, base + 0.1 + 0.01 * (seed % 3), grad=6.0),
                 record("M2PO", "spg 32", 1e-3, seed, base + (0.05 if seed % 2 else -0.05), grad=150.0)]
    text, claims = evidence_study.report(runs, str(REPO / "benchmarks" / "results" / "x.jsonl"), resamples=2000)
    assert "final reward: **BAPO paper** against TRL dapo clip-higher: beats, +0." in text
    assert "max grad norm: **BAPO paper** against TRL dapo clip-higher: smaller, -144.0" in text
    assert "**M2PO** against TRL dapo clip-higher: beats" not in text  # +-0.05 alternating: a tie
    assert "**M2PO** against TRL dapo clip-higher: loses" not in text
    # the at-a-glance matrix: a bold verdict where the interval excludes zero, a plain tie for M2PO
    glance = text.split("## At a glance: largest gradient norm")[0]
    assert "| BAPO paper + dual clip - M2PO | - |" in glance  # that pair did not run: a dash, not a verdict
    assert claims == 2 and "## spg 32, lr 0.001 (seeds 100-111)" in text
    # the same comparison on 5 seeds: no claim, however large the difference
    few = [r for r in runs if r["seed"] < 105]
    assert evidence_study.report(few, str(REPO / "x.jsonl"), resamples=2000)[1] == 0


def test_plan_runs_the_headline_first_seed_by_seed_and_the_twins_where_only_bapo_runs():
    todo = evidence_study.plan(["spg 32", "replay 0.5"], [100, 101], [100])
    head = [r for r in todo if r["staleness"] == "spg 32"]
    assert todo[: len(head)] == head and len(head) == 2 * 2 * len(evidence_study.METHODS)
    assert [r["seed"] for r in head] == [100] * (len(head) // 2) + [101] * (len(head) // 2)
    replay = {r["method"]: r["trainer"] for r in todo if r["staleness"] == "replay 0.5"}
    assert set(replay) == set(evidence_study.OTHER_METHODS) and "trl" not in replay.values()
    assert replay["M2PO"] == "m2po-bapo" and replay["TRL GSPO"] == "bapo"


@pytest.mark.parametrize("name", ["runs.jsonl", "runs.jsonl.gz"])
def test_runs_files_read_plain_or_gzipped_and_a_torn_last_line_is_dropped(tmp_path, name):
    """The published runs (docs/data/*.jsonl.gz) read as the study's own file does; a run killed mid-write leaves a
    torn last line, which is skipped rather than failing the report."""
    text = json.dumps({"seed": 1}) + "\n" + json.dumps({"seed": 2}) + "\n" + '{"seed": 3, "rew'
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    assert read_jsonl(str(path)) == [{"seed": 1}, {"seed": 2}]
    assert read_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_the_at_a_glance_matrix_has_a_column_per_cell_and_a_verdict_only_from_enough_pairs():
    runs = []
    for seed in range(100, 112):  # spg 32: 12 pairs, the default ahead by ~0.1; spg 8: only 5 pairs
        base = 0.5 + 0.02 * (seed % 5)
        runs += [record("TRL dapo clip-higher", "spg 32", 2e-3, seed, base),
                 record("BAPO paper + dual clip", "spg 32", 2e-3, seed, base + 0.1 + 0.01 * (seed % 3)),
                 record("BAPO paper", "spg 32", 2e-3, seed, base + 0.1 + (0.05 if seed % 2 else -0.05))]
        if seed < 105:
            runs += [record("TRL dapo clip-higher", "spg 8", 2e-3, seed, base),
                     record("BAPO paper + dual clip", "spg 8", 2e-3, seed, base + 0.3)]
    table = evidence_study.summary(runs, resamples=2000).splitlines()
    assert table[0] == "| lr 0.002: method - reference | spg 32 | spg 8 |"
    row = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table[2:]}
    assert row["BAPO paper + dual clip - TRL dapo clip-higher"][0].startswith("**beats** +0.1")
    assert row["BAPO paper + dual clip - TRL dapo clip-higher"][1] == "- |"  # 5 pairs: no verdict at all
    assert row["BAPO paper + dual clip - BAPO paper"][0].startswith("ties ")


def test_the_documented_gspo_is_a_rival_in_every_cell_and_the_eps_0_2_run_is_named_a_variant():
    assert "TRL GSPO (documented)" in evidence_study.OTHER_METHODS and "TRL GSPO" in evidence_study.OTHER_METHODS
    todo = evidence_study.plan(list(evidence_study.SCENARIOS), [100], [100])
    for scenario in evidence_study.SCENARIOS:
        runs = [r for r in todo if r["staleness"] == scenario and r["method"] == "TRL GSPO (documented)"]
        assert len(runs) == len(evidence_study.LEARNING_RATES), scenario
        assert runs[0]["settings"]["importance_sampling_level"] == "sequence"
    for method in ("BAPO paper + dual clip", "BAPO GSPO + dual clip"):
        assert (method, "TRL GSPO (documented)") in evidence_study.PAIRS
    runs = []
    for seed in range(100, 110):
        runs += [record("TRL GSPO", "spg 8", 1e-3, seed, 0.5 + 0.01 * (seed % 3)),
                 record("BAPO GSPO + dual clip", "spg 8", 1e-3, seed, 0.6),
                 record("TRL dapo clip-higher", "spg 8", 1e-3, seed, 0.4)]
    text, _ = evidence_study.report(runs, str(REPO / "x.jsonl"), resamples=500)
    assert "| BAPO GSPO + dual clip - TRL GSPO eps 0.2 (variant) |" in text
    assert "| TRL GSPO eps 0.2 (variant) | bapo | 10 |" in text and "| TRL GSPO |" not in text
    assert {r["method"] for r in runs} >= {"TRL GSPO"}  # the runs keep their names


def test_a_task_other_than_the_published_one_is_in_the_run_and_its_key():
    from study import DEFAULT_TASK, TASKS, run_key, task_of

    old = evidence_study.spec_for("BAPO paper", "spg 32", 1e-3, 100, 160)
    new = evidence_study.spec_for("BAPO paper", "spg 32", 1e-3, 100, 160, task="reverse2-8")
    assert "task" not in old and task_of(old) == DEFAULT_TASK == "reverse3"
    assert run_key(old) == ("BAPO paper", "spg 32", 1e-3, 100, 160)  # the published runs' keys are unchanged
    assert run_key(new) == (*run_key(old), "reverse2-8") and new["task"] == "reverse2-8"
    assert all(r.get("task") == "reverse2-8" for r in evidence_study.plan(["spg 8"], [1], [1], task="reverse2-8"))
    assert TASKS["reverse3"]["max_completion_length"] == 12 and TASKS["reverse3"]["model"] == {}
    assert TASKS["reverse2-8"]["digits"] == (2, 8) and TASKS["reverse2-8"]["max_completion_length"] >= 8 + 1
    assert evidence_study.default_paths("reverse3") == (evidence_study.RESULTS, evidence_study.REPORT)
    assert all("reverse2-8" in path for path in evidence_study.default_paths("reverse2-8"))


def test_report_writes_the_forest_plot_and_the_reward_curves(tmp_path):
    """``--report`` on a runs file alone writes both figures beside the report, as small palette PNGs, and links
    them; the forest plot has a row per pair and cell with enough seeds, the curves one per method and rate."""
    from PIL import Image

    runs = []
    for seed in range(100, 112):
        base = 0.5 + 0.02 * (seed % 5)
        for lr in (1e-3, 2e-3):
            for method, gain in (("TRL dapo clip-higher", 0.0), ("BAPO paper + dual clip", 0.1), ("TRL GSPO", 0.05)):
                runs.append(dict(record(method, "spg 32", lr, seed, base + gain),
                                 rewards=[0.3, 0.4 + gain, 0.5 + gain, base + gain, base + gain]))
                if seed < 110:
                    runs.append(dict(record(method, "spg 8", lr, seed, base + gain / 2), rewards=[0.3] * 20))
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    out = tmp_path / "report.md"
    assert evidence_study.main(["--report", "--results", str(path), "--report-out", str(out),
                                "--resamples", "500"]) == 0
    for name in ("report_forest.png", "report_rewards.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000, name
        image = Image.open(tmp_path / name)
        assert image.mode == "P" and image.size[0] >= 1000 and len(image.getcolors(256)) > 8, name
        assert f"]({name})" in out.read_text()
    # the default against clip-higher and against GSPO eps 0.2, in 2 scenarios x 2 rates
    assert evidence_study.forest_plot(runs, str(tmp_path / "f.png"), resamples=500) == 2 * 2 * 2
    assert evidence_study.reward_curves(runs, str(tmp_path / "c.png")) == (3 * 2, "spg 32")
    few = [r for r in runs if r["seed"] < 105]  # 5 pairs: no row, but still a figure
    assert evidence_study.forest_plot(few, str(tmp_path / "g.png"), resamples=500) == 0
    assert (tmp_path / "g.png").stat().st_size > 0


def test_the_second_round_rule_gives_each_task_its_own_cells_and_the_command_prints_it(tmp_path, capsys):
    """Runs of two tasks share (scenario, lr) and seeds: each task is its own cell (merged, one task's runs would
    overwrite the other's and hide a loss). The length-fair band ties on 3 digits and loses on 2-8 digits, so the
    rule keeps GSPO-scale x10; `--choose` prints the same over the runs files."""
    rival, narrow, balanced = evidence_study.RIVAL, "BAPO length-fair narrow", "BAPO GSPO-scale x10"
    three, varied = [], []
    for seed in range(100, 110):
        wobble = 0.01 * (seed % 3)
        three += [record(m, "spg 32", 1e-3, seed, value + wobble)
                  for m, value in ((rival, 0.5), (balanced, 0.52), (narrow, 0.6))]
        varied += [dict(record(m, "spg 32", 1e-3, seed, value + wobble), task="reverse2-8")
                   for m, value in ((rival, 0.5), (balanced, 0.5), (narrow, 0.3))]
    chosen, lines = evidence_study.choose(three + varied, evidence_study.SECOND_ROUND, resamples=2000)
    assert chosen == balanced and "(loses no cell)" in lines[-1]
    assert any(line.startswith(f"| {narrow} | 2 | 1 | 1 |") and "2-8 digits spg 32, lr 0.001 -0.200" in line
               for line in lines), lines
    assert evidence_study.choose(three, evidence_study.SECOND_ROUND, resamples=2000)[0] == narrow  # one task alone
    text, claims = evidence_study.report(three, "three.jsonl", resamples=2000)
    assert "## Issue 53's second round on these runs" in text and f"Chosen by the rule: **{narrow}**" in text
    assert "the default has no runs paired with it here, so the default rule cannot be judged" in text
    assert f"| {narrow} | BAPO GSPO-scale x10 | 10 |" in text  # the pair in the cell's table, and its claim
    assert any(f"**{narrow}** against BAPO GSPO-scale x10" in line for line in text.splitlines())
    first, second = tmp_path / "three.jsonl", tmp_path / "varied.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in three))
    second.write_text("".join(json.dumps(r) + "\n" for r in varied))
    assert evidence_study.main(["--choose", "--results", str(first), "--with-runs", str(second), "--methods",
                                *evidence_study.SECOND_ROUND, "--resamples", "2000"]) == 0
    assert f"Chosen by the rule: **{balanced}** (loses no cell)." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evidence_study.main(["--choose", "--results", str(tmp_path / "none.jsonl")])
    assert "--choose: no runs file" in capsys.readouterr().err
    # runs of the third round's candidate (BAPO on GMPO): its rule over all three picks, and its pair with TRL's GMPO
    gmpo = [record(m, "spg 32", 1e-3, seed, value + 0.01 * (seed % 3)) for seed in range(100, 110)
            for m, value in (("BAPO GMPO balanced", 0.7), ("TRL GMPO (documented)", 0.55))]
    text, _ = evidence_study.report(three + gmpo, "three.jsonl", resamples=2000)
    assert "## Issue 53's third round on these runs" in text and "Chosen by the rule: **BAPO GMPO balanced**" in text
    assert "| BAPO GMPO balanced | TRL GMPO (documented) | 10 |" in text


def test_the_choice_rule_skips_a_candidate_that_loses_a_cell_and_the_default_rule_names_each_loss():
    """Issue 53's protocol on made-up runs: "M2PO then balance" has the largest mean difference against the documented
    GSPO but loses one cell, so "BAPO GSPO-scale x10" (smaller mean, no loss) is chosen; the default rule then holds
    only while the chosen one loses to no rival and beats the default in a third of the cells."""
    rival, default = evidence_study.RIVAL, evidence_study.DEFAULT_METHOD
    runs = []
    for seed in range(100, 110):
        wobble = 0.01 * (seed % 3)
        for cell in (("spg 32", 1e-3), ("spg 8", 1e-3), ("replay 0.5", 1e-3)):
            big = -0.2 if cell[0] == "spg 8" else 0.4  # the big-mean candidate loses staleness 8
            runs += [record(rival, *cell, seed, 0.5 + wobble), record(default, *cell, seed, 0.45 + wobble),
                     record("TRL dapo clip-higher", *cell, seed, 0.4 + wobble),
                     record("BAPO GSPO-scale x10", *cell, seed, 0.55 + 2 * wobble),
                     record("M2PO then balance", *cell, seed, 0.5 + big + wobble)]
    chosen, lines = evidence_study.choose(runs, resamples=2000)
    assert chosen == "BAPO GSPO-scale x10"
    assert lines[-1].strip() == "Chosen by the rule: **BAPO GSPO-scale x10** (loses no cell)."
    assert any(line.startswith("| M2PO then balance | 3 | 2 | 1 |") for line in lines)
    holds, text = evidence_study.default_rule(runs, chosen, resamples=2000)
    assert holds and "beats the default in 3 of 3 cells" in text[0]
    # the chosen one now loses staleness 8 to TRL's clip-higher: the rule fails, naming that cell and rival
    worse = [dict(r, reward_final=0.3 + 0.01 * (r["seed"] % 3))
             if (r["method"], r["staleness"]) == ("BAPO GSPO-scale x10", "spg 8") else r for r in runs]
    holds, text = evidence_study.default_rule(worse, chosen, resamples=2000)
    assert not holds and any(line.startswith("- spg 8, lr 0.001: loses to TRL dapo clip-higher") for line in text)
    # every candidate loses one cell: the fewest losses, then the largest mean (M2PO then balance's +0.2)
    both = [dict(r, reward_final=0.2) if (r["method"], r["staleness"]) == ("BAPO GSPO-scale x10", "spg 8") else r
            for r in runs]
    chosen, lines = evidence_study.choose(both, resamples=2000)
    assert chosen == "M2PO then balance" and "every candidate loses a cell; it loses 1" in lines[-1]


def test_the_drop_in_study_runs_each_config_as_is_on_both_trainers_and_checks_the_written_claim():
    """benchmarks/dropin_study.py (issue 64): BAPO(C) and TRL(C) run the same fields C (BAPO's path is the rule's,
    no ratio_* field added); on synthetic runs the claim holds only with no 'loses' and at least one 'beats'."""
    import dropin_study

    from bapo_trl import BAPOConfig
    from bapo_trl.core.window_rule import RATIO_FIELDS

    todo = dropin_study.specs(dropin_study.CONFIGS, ["spg 8"], [100], (1e-3,))
    assert len(todo) == 2 * len(dropin_study.CONFIGS)
    for bapo, trl in zip(todo[::2], todo[1::2]):
        assert (bapo["trainer"], trl["trainer"]) == ("bapo", "trl") and bapo["settings"] == trl["settings"]
        assert not set(bapo["settings"]) & set(RATIO_FIELDS)
        BAPOConfig(output_dir="unused", use_cpu=True, steps_per_generation=2, **bapo["settings"])  # a valid config
    for scenario, rival in dropin_study.BAPO_SCENARIOS.items():  # TRL(C)'s rival scenario is one TRL's trainer runs
        assert rival in STALENESS and rival not in BAPO_ONLY, (scenario, rival)
        trl_runs = [s for s in dropin_study.specs(["SAPO"], [scenario], [100], (1e-3,)) if s["trainer"] == "trl"]
        assert [s["staleness"] for s in trl_runs] == [rival]
    bapo_async, trl_rival = dropin_study.specs(["VESPO"], ["async K=1"], [100], (1e-3,))  # TRL's VESPO + vLLM rule
    vespo = dropin_study.CONFIGS["VESPO"]
    assert bapo_async["settings"] == dict(vespo, vllm_importance_sampling_mode="token_truncate")
    assert trl_rival["settings"] == vespo  # no vLLM there: VESPO as documented

    def runs(config, cell, diffs):
        bapo, trl = dropin_study.methods(config)
        out = []
        for seed, diff in enumerate(diffs):
            out += [dict(method=bapo, staleness=cell[0], lr=cell[1], seed=seed, reward_final=0.5 + diff),
                    dict(method=trl, staleness=cell[0], lr=cell[1], seed=seed, reward_final=0.5)]
        return out

    beats, ties, loses = [0.10 + 0.01 * i for i in range(10)], [(-1) ** i * 0.05 for i in range(10)], [
        -0.1 - 0.01 * i for i in range(10)]
    synthetic = (runs("TRL defaults", ("spg 8", 1e-3), beats) + runs("TRL defaults", ("spg 32", 1e-3), ties)
                 + runs("SAPO", ("spg 8", 1e-3), ties) + runs("VESPO", ("spg 8", 1e-3), beats)
                 + runs("VESPO", ("spg 32", 1e-3), loses))
    rows, verdicts = dropin_study.table(synthetic, resamples=2000)
    assert verdicts == {"TRL defaults": {("spg 8", 1e-3): "beats", ("spg 32", 1e-3): "ties"},
                        "SAPO": {("spg 8", 1e-3): "ties"},
                        "VESPO": {("spg 8", 1e-3): "beats", ("spg 32", 1e-3): "loses"}}
    claim = dropin_study.claim(verdicts)
    assert claim[0].startswith("- TRL defaults: holds") and claim[1].startswith("- SAPO: FAILS")
    assert claim[2].startswith("- VESPO: FAILS (1 beats, 1 loses")
    assert rows[0].startswith("| config | staleness 8, lr 0.001 | staleness 32, lr 0.001 |")


def test_the_drop_in_readme_table_runs_each_beat_again_on_the_second_fresh_set_and_says_how_it_stood():
    """Issue 77 (7): every cell that beats on the confirmation seeds (and only those) runs again on the second fresh
    set; the README's cell says ``again: <verdict>`` (``pending`` before those runs), with three decimals."""
    import dropin_study

    confirm = dropin_study.parse_seeds(dropin_study.CONFIRM_SEEDS, count=False)
    second = dropin_study.parse_seeds(dropin_study.REPLICATION_SEEDS, count=False)
    assert not set(confirm) & set(second)

    def pair(config, scenario, lr, seeds, gain):
        bapo, trl = dropin_study.methods(config)
        return [dict(method=m, staleness=scenario, lr=lr, seed=s, steps=160,
                     reward_final=0.5 + (gain + 0.001 * (s % 3 - 1)) * (m == bapo))
                for s in seeds for m in (bapo, trl)]

    runs = pair("TRL defaults", "spg 32", 1e-3, confirm, 0.1) + pair("SAPO", "spg 8", 2e-3, confirm, 0.0)
    todo = dropin_study.replication_specs({"reverse3": runs})
    assert {(s["method"], s["staleness"], s["lr"]) for s in todo} == {
        ("BAPO(TRL defaults)", "spg 32", 1e-3), ("TRL(TRL defaults)", "spg 32", 1e-3)}
    assert sorted({s["seed"] for s in todo}) == second
    table = "\n".join(dropin_study.readme_table({"reverse3": runs}, resamples=200))
    assert "**+0.100 [" in table and "again: pending" in table
    runs += pair("TRL defaults", "spg 32", 1e-3, second, 0.0)  # the second set ties it
    table = "\n".join(dropin_study.readme_table({"reverse3": runs}, resamples=200))
    assert "again: ties" in table and "| its beats again on seeds 1000-1019 | 0 of 1 beats |" in table


def test_the_async_overlap_bound_counts_the_servers_load_of_each_push():
    """The server cannot generate while it loads a push (the generation thread applies it between two requests), so
    the ideal pipelined step is max(g + load, t), not max(g, t): with g 0.037, load 0.017, t 0.023 the bound is
    0.054 s, where the runs measured 0.055."""
    import async_anchor_study

    run = {"trainer": "BAPO async K=1", "config": "TRL defaults", "task": "reverse3", "seed": 1, "rows": [],
           "seconds": 5.5, "steps": 100, "means": {"async/generate_seconds": 0.037, "async/wait_seconds": 0.032,
                                                   "async/push_seconds": 0.005, "async/load_seconds": 0.017}}
    (line,) = async_anchor_study.overlap_bound([run])
    assert "t = 0.023 s" in line and "max(g + load, t) = 0.054 s a step" in line, line


def probe_run(trainer: str, seed: int, logged: float, generated: float, heldout: float, dropped: float = 0.0,
              steps: int = 160) -> dict:
    """A synthetic probe run: ``steps`` steps of 32 samples trained (and ``dropped`` a step), each logging
    ``logged``."""
    history = [{"step": i + 1, "reward": logged, "sample/dropped_stale_total": dropped} for i in range(steps)]
    return {"trainer": trainer, "config": "TRL defaults", "task": "reverse2-8", "seed": seed, "probe": "heldout-5120",
            "until_samples": 5120, "history": history, "step_seconds": [0.1 * (i + 1) for i in range(steps)],
            "steps": steps, "scored_mean": generated, "scored_count": 5120, "heldout_sampled": heldout,
            "heldout_greedy": heldout, "wall_seconds": 20.0}


def test_the_probe_reads_a_trainer_that_drops_samples_by_its_held_out_score_not_its_logged_reward():
    """A trainer whose logged reward covers only the samples it kept reads higher than it scores on held-out prompts:
    the probe's report shows both, and the gap between its samples trained and its samples generated."""
    import async_anchor_study as study

    runs = []
    for seed in (1, 2, 3):
        runs.append(probe_run("TRL sync", seed, logged=0.30, generated=0.30, heldout=0.30 + 0.01 * seed))
        runs.append(probe_run("TRL async", seed, logged=0.70, generated=0.40, heldout=0.31 + 0.01 * seed, dropped=16))
    stopped_by_the_cap = probe_run("TRL async", 4, logged=0.9, generated=0.9, heldout=0.9, steps=100)  # 3200 samples
    report = study.probe_report([*runs, {**runs[0], "probe": None}, stopped_by_the_cap])  # a study run: no probe
    assert "Left out: 1 heldout-5120 run(s) the 30 s cap stopped before 5120 samples (TRL async seed 4)." in report
    assert "seeds 1-3 (6 runs)" in report and "## heldout-5120: reverse2-8, TRL defaults" in report, report
    assert "| TRL async | 160 | 33% | 0.70 | 0.33 | 0.33 | +0.30 |" in report, report
    row = "| TRL async - TRL sync | **+0.40 [+0.40, +0.40]** | **+0.01 [+0.01, +0.01]** | **+0.01 [+0.01, +0.01]** |"
    assert row in report, report


def test_a_probe_run_stops_at_its_samples_and_scores_every_sample_and_the_held_out_prompts(use_test_cache,
                                                                                         monkeypatch):
    """train_one with a probe's spec, on TRL's synchronous trainer (no server): it stops once 64 samples are consumed
    (2 steps of 32), its reward log saw those 64 samples, and its policy is scored on the held-out prompts (the task's
    test split), sampled and greedy."""
    import async_anchor_study as study
    import torch

    monkeypatch.setattr(study, "HELDOUT_PROMPTS", 64)
    spec = dict(trainer="TRL sync", config="TRL defaults", task="reverse3", seed=1, probe="heldout-5120",
                until_samples=64)
    threads = torch.get_num_threads()
    try:
        run = study.train_one(spec, None, study.BUDGET_STEPS, study.SECONDS_CAP)
    finally:
        torch.set_num_threads(threads)  # a synchronous run takes 2; this worker's other tests hold one
    assert run["steps"] == 2 and run["scored_count"] == 64, (run["steps"], run["scored_count"])
    rewards = [h["reward"] for h in run["history"] if "reward" in h]
    assert run["scored_mean"] == pytest.approx(statistics.mean(rewards))  # nothing dropped: all it generated
    assert 0 <= run["heldout_greedy"] <= 1 and 0 <= run["heldout_sampled"] <= 1
    assert set(run["heldout_by_digits"]["greedy"]) == {3}


def test_the_study_skips_the_committed_runs_unless_asked_to_run_them_again(tmp_path, monkeypatch):
    """A run already committed is skipped (a resumed study, a fresh machine); ``--again`` runs it again, to reproduce
    a published number. The runs themselves are a STAND-IN here (the harness's child process, replaced by a function
    that records what it was asked to run): what is tested is which runs the study starts."""
    import async_anchor_study as anchor

    ran = []

    def stand_in_run(spec, url, steps, cap, log):
        ran.append((spec["trainer"], spec["seed"]))
        return dict(spec, history=[{"step": 1, "reward": 0.5}], step_seconds=[0.1], steps=1), 0.0

    monkeypatch.setattr(anchor, "run_in_child", stand_in_run)
    todo = anchor.plan([1], ["reverse3"], ["TRL defaults"], ["TRL sync", "BAPO sync"])
    committed = tmp_path / "committed.jsonl"
    committed.write_text(json.dumps(dict(todo[0], rows=[])) + "\n")  # one of the two, committed
    anchor.study(todo, tmp_path / "resumed.jsonl", 8, 10.0, committed=committed)
    assert ran == [(todo[1]["trainer"], 1)], ran
    ran.clear()
    anchor.study(todo, tmp_path / "again.jsonl", 8, 10.0, committed=None)  # --again
    assert sorted(ran) == [("BAPO sync", 1), ("TRL sync", 1)], ran
    assert len(read_jsonl(str(tmp_path / "again.jsonl"))) == 2
