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
