"""Named settings: ``BAPOConfig`` fields that belong together, under one name, so that a user runs what the studies
ran (``BAPOConfig(output_dir=..., **gspo_balanced())``).

Why a function of plain numbers: the studies (``benchmarks/study.py``) build their runs from the same function, so
the published results and a user's run cannot drift apart; nothing here imports torch or TRL.
"""

from __future__ import annotations

from ..core.window_rule import SEQUENCE_SCALE, sequence_widening, window_path

#: GSPO as TRL documents it for the GSPO paper's setting (TRL's paper index): the sequence-level ratio, loss ``grpo``,
#: a narrow window (the mean log-ratio of a sequence moves far less than a token's), no KL term.
GSPO_DOCUMENTED = dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                       beta=0.0)


def gspo_balanced(scale: float = SEQUENCE_SCALE) -> dict:
    """BAPO's balance of GSPO's sequence-level ratio, on a search path around TRL's documented GSPO window:
    ``c_high`` from ``1 + epsilon_high`` to ``1 + 10 x scale x epsilon_high`` (37 points), ``c_low`` from
    ``1 - 3 x scale x epsilon`` to ``1 - epsilon`` (16 points), with GSPO's ``epsilon = 3e-4``, ``epsilon_high =
    4e-4``; loss ``grpo``, sequence level, ``beta=0``, the dual clip on (``BAPOConfig``'s default). ``c_high`` starts
    at GSPO's own bound; ``c_low`` starts 3 x scale times wider than GSPO's and reaches GSPO's bound at the path's end.
    The default ``scale=10``: ``c_high`` from 1.0004 up to 1.04, ``c_low`` from 0.991 up to 0.9997, which is the path
    ``BAPOConfig`` derives from GSPO's documented window by itself (:mod:`bapo_trl.core.window_rule`).

    ``scale=10`` is the setting the study chose ("BAPO GSPO-scale x10" in docs/results.md: of the scales 1, 2,
    4, 10 and 25 it had the largest paired difference against the documented GSPO on the development seeds)."""
    if not (isinstance(scale, (int, float)) and scale >= 1):
        raise ValueError(f"gspo_balanced: `scale` must be a number >= 1, got {scale!r}")
    gspo = {name: GSPO_DOCUMENTED[name] for name in ("loss_type", "importance_sampling_level", "beta")}
    return dict(gspo, **window_path(GSPO_DOCUMENTED["epsilon"], GSPO_DOCUMENTED["epsilon_high"],
                                    sequence_widening(scale)))
