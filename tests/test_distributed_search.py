"""A real 2-process accelerate launch (gloo on CPU): ranks with different data pick identical bounds."""

import json

import pytest

from support.launching import REPO, accelerate_launch

pytestmark = pytest.mark.slow


def test_two_ranks_with_different_data_agree_on_the_bounds(tmp_path):
    accelerate_launch(REPO / "tests" / "dist_scripts" / "search_agreement.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for info in ranks:
        assert info["world_size"] == 2 and info["backend"] == "gloo"
        assert info["distributed_type"] == "DistributedType.MULTI_CPU"
    local_differs = 0
    for rec0, rec1 in zip(ranks[0]["records"], ranks[1]["records"]):
        assert rec0["global"] == rec1["global"], rec0["case"]  # bit-identical choice on both ranks
        assert rec0["collectives"] == rec1["collectives"] == 1  # ONE reduction per search
        ref = rec0["reference"]  # a plain loop over the union of both ranks' tokens
        assert rec0["global"]["clip_low"] == pytest.approx(ref["clip_low"], abs=1e-9)
        assert rec0["global"]["clip_high"] == pytest.approx(ref["clip_high"], abs=1e-9)
        assert rec0["global"]["steps"] == ref["steps"]
        for rec in (rec0, rec1):
            local_differs += (rec["local"]["clip_low"], rec["local"]["clip_high"]) != (
                rec["global"]["clip_low"], rec["global"]["clip_high"])
    assert local_differs > 0, "the data must be different enough that local searches would disagree"
