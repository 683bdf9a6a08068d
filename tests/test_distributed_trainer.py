"""A real 2-process run of BAPOTrainer's loss: different data per rank, and a rank with an empty micro-batch."""

import json
import math

import pytest

from support.launching import REPO, accelerate_launch

pytestmark = pytest.mark.slow


def test_ranks_agree_and_an_empty_rank_does_not_deadlock(tiny_model_dir, tmp_path):
    accelerate_launch(REPO / "tests" / "dist_scripts" / "trainer_agreement.py", tiny_model_dir, tmp_path, timeout=600)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    assert any(rec["empty"] for rec in r1["records"])
    moved = 0
    for a, b in zip(r0["records"], r1["records"]):
        assert (a["clip_low"], a["clip_high"], a["steps"]) == (b["clip_low"], b["clip_high"], b["steps"]), a["case"]
        assert math.isfinite(a["loss"]) and math.isfinite(b["loss"])
        moved += a["steps"] > 0
    assert moved > 0
