"""Partial-rollout runs recorded for checking: the completions handed to TRL for scoring, and each segment's log-probs
recomputed with the policy saved at its version."""

from transformers import AutoModelForCausalLM

from bapo_trl.rollout import PartialRollout
from support.harness import Probe, check_behaviour_logps


def record_scored(trainer, pop_ready, num_groups):
    """Keeps every completion handed to TRL for scoring, in order (around the pool's real pop_ready)."""
    groups = pop_ready(num_groups)
    trainer.trained += [c for g in groups for c in g.completions]
    return groups


RECORDING = dict(cls=Probe, around={(PartialRollout, "pool.pop_ready"): record_scored}, record=("trained",))


def segment_logps_match_saved_policies(trained, snapshots, model_dir, temperature, limit=12, model=None):
    """For completions spanning several steps, recompute each segment's log-probs with the policy saved at that
    segment's version and compare with what was stored. Returns the versions checked and how far the NEWEST policy
    of each completion is from the stored log-probs of its older segments (> 0: the segments really differ).
    ``model``: a copy of the trained model to load the snapshots into (e.g. a peft model), else ``model_dir``'s."""
    model = (model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir)).eval()
    checked, gap = set(), 0.0
    for c in [c for c in trained if c.segments > 1][:limit]:
        gap = max(gap, check_behaviour_logps(model, snapshots.policies, c.prompt_ids, c.token_ids, c.versions, c.logps,
                                             atol=1e-4, temperature=temperature, newest=max(c.versions)))
        checked |= set(c.versions)
    return checked, gap
