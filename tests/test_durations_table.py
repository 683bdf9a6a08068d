"""scripts/durations_table.py reads a `.ci/run` log into the durations table CONTRIBUTING links."""

from __future__ import annotations

import sys

from support.launching import REPO

sys.path.insert(0, str(REPO / "scripts"))
import durations_table  # noqa: E402

LOG = """
============================= slowest durations ==============================
12.50s call     tests/test_a.py::test_one
0.50s setup    tests/test_a.py::test_one
3.00s call     tests/test_b.py::test_two[x]
======= 2 passed, 3 warnings in 20.00s =======
============================= slowest durations ==============================
60.00s call     tests/test_c.py::test_slow
======= 1 failed, 4 passed in 120.00s (0:02:00) =======
============================= slowest durations ==============================
30.00s call     tests/test_a.py::test_launch
======= 1 passed, 1 deselected in 30.00s =======
"""


def test_each_tier_its_wall_time_counts_and_summed_test_time():
    runs = durations_table.parse(LOG.splitlines())
    assert [(r["passed"], r["failed"], r["wall"]) for r in runs] == [(2, 0, 20.0), (4, 1, 120.0), (1, 0, 30.0)]
    assert runs[0]["tests"] == {"tests/test_a.py::test_one": 13.0, "tests/test_b.py::test_two[x]": 3.0}
    text = durations_table.table(runs)
    assert "| fast | 0.3 | 2 | 0 | 0.3 |" in text and "| all | 2.8 | 7 | 1 | 1.8 |" in text
    assert "| 43 | `tests/test_a.py` |" in text  # the file's tests over every tier


def junit(path, seconds: float) -> str:
    """A pytest JUnit file of a run that took ``seconds`` (the shape pytest writes: testsuites > testsuite)."""
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
                    f'failures="0" skipped="0" tests="3" time="{seconds}"></testsuite></testsuites>')
    return str(path)


def test_the_budget_check_fails_a_run_whose_fast_tier_or_whole_suite_is_over_and_names_it(tmp_path, capsys):
    """Issue 78 (5): ``make test`` ends with ``--check`` on its tiers' JUnit files: 5 minutes for the fast tier, 35 for
    all of them; over either, exit 1 naming which; within both, exit 0."""
    assert durations_table.BUDGET_MINUTES == {"fast": 5.0, "all": 35.0}
    within = [junit(tmp_path / "a.xml", 290), junit(tmp_path / "b.xml", 900), junit(tmp_path / "c.xml", 900)]
    assert durations_table.main(["--check", *within]) == 0
    assert "fast tier 4.8 min, all 34.8 min" in capsys.readouterr().out
    slow_fast = [junit(tmp_path / "d.xml", 301), *within[1:]]
    assert durations_table.main(["--check", *slow_fast]) == 1
    assert "the fast tier took 5.0 min, over its budget of 5 min" in capsys.readouterr().err
    long_suite = [within[0], junit(tmp_path / "e.xml", 1200), within[2]]
    assert durations_table.main(["--check", *long_suite]) == 1
    err = capsys.readouterr().err
    assert "the whole suite took 39.8 min, over its budget of 35 min" in err and "fast tier" not in err


def test_make_test_writes_each_tiers_junit_file_and_ends_with_the_budget_check():
    from support.launching import REPO

    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\ntest: install-test\n")[1].split("\n\n")[0]
    for tier in ("fast", "slow-side", "slow-serial"):
        assert f"--junitxml=$(JUNIT_DIR)/{tier}.xml" in target, tier
        assert f"$(JUNIT_DIR)/{tier}.xml" in makefile.split("DURATIONS_CHECK ?=")[1].split("\n\n")[0], tier
    assert target.strip().splitlines()[-1].strip() == "$(DURATIONS_CHECK)"
