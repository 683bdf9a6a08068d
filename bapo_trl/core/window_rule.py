"""The search path BAPO derives from the window the user set: start at it, and widen it only as far as the balance
needs.

Why a rule: a TRL user who swaps ``GRPOConfig`` for ``BAPOConfig`` keeps their ``epsilon``/``epsilon_high`` and
``importance_sampling_level``. The paper's path is this rule at TRL's default window (``epsilon=0.2``, token ratios:
``c_high`` 1.2..3.0, ``c_low`` 0.6..0.9); GSPO's documented window (``3e-4``/``4e-4`` on a sequence's mean
log-ratio, which moves far less than a token's) gets the path the candidate studies chose for it
(``gspo_balanced()``), instead of the paper's, which is hundreds of times wider there and lost to GSPO itself on
fresh seeds (docs/results.md).

The path, bound by bound, for a window ``[1 - e, 1 + h]`` (``h``: ``epsilon_high``, or ``epsilon`` when unset, as
TRL reads it) at a level with widening ``(U, W, N)`` (:data:`WIDENING`):

- ``c_high`` from ``1 + h`` (the user's bound) up to ``1 + U h``, in :data:`UPPER_POINTS` points;
- ``c_low`` from ``1 - W e`` (the widest) up to ``1 - N e``, in :data:`LOWER_POINTS` points (the paper's search
  raises ``c_low`` from its widest value; its last point, ``1 - N e``, is the narrowest).

Nothing here runs per step: ``BAPOConfig`` computes the path once, when it is built. Plain numbers, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Points on each bound's path: the paper's (c_high 1.2..3.0 by 0.05: 37; c_low 0.6..0.9 by 0.02: 16).
UPPER_POINTS, LOWER_POINTS = 37, 16


@dataclass(frozen=True)
class Widening:
    """How far the search widens a window, in multiples of its half-widths: ``c_high`` up to ``1 + upper h``,
    ``c_low`` from ``1 - lower_widest e`` up to ``1 - lower_narrowest e``."""

    upper: float
    lower_widest: float
    lower_narrowest: float


def sequence_widening(scale: float) -> Widening:
    """The sequence-level widening at ``scale`` (the candidate study's "GSPO-scale x<scale>" rows): c_high to
    ``1 + 10 scale h``, c_low from ``1 - 3 scale e`` to ``1 - e``."""
    return Widening(upper=10.0 * scale, lower_widest=3.0 * scale, lower_narrowest=1.0)


#: The scale the candidate study's dev runs chose among 1, 2, 4, 10 and 25 ("BAPO GSPO-scale x10", seeds 100-109),
#: confirmed on seeds 300-319 and 400-419 (docs/results.md).
SEQUENCE_SCALE = 10.0
#: Per ratio level. Token: the paper's path read at TRL's default ``epsilon = 0.2`` (3.0 = 1 + 10 x 0.2, 0.6 = 1 - 2
#: x 0.2, 0.9 = 1 - 0.5 x 0.2; the paper's own runs). Sequence: ``gspo_balanced()``'s, at :data:`SEQUENCE_SCALE`:
#: c_high to 1 + 100 h, c_low from 1 - 30 e to 1 - e.
WIDENING = {
    "token": Widening(upper=10.0, lower_widest=2.0, lower_narrowest=0.5),
    "sequence": sequence_widening(SEQUENCE_SCALE),
}

#: The ratio fields the rule derives (``BAPOConfig`` fields; one the user sets overrides the rule for that field).
RATIO_FIELDS = ("ratio_lower_start", "ratio_lower_max", "ratio_lower_step",
                "ratio_upper_start", "ratio_upper_max", "ratio_upper_step")

#: TRL's default ``epsilon``, at which the token rule is the paper's path.
PAPER_EPSILON = 0.2
#: The paper's path (the rule at TRL's default window, and the path of a loss without a user window).
PAPER_PATH = dict(ratio_lower_start=0.6, ratio_lower_max=0.9, ratio_lower_step=0.02,
                  ratio_upper_start=1.2, ratio_upper_max=3.0, ratio_upper_step=0.05)


#: Where a window is too wide to widen ``c_low`` below it (``1 - W e <= 0``): the widest ``c_low`` is a quarter of
#: the narrowest, and the narrowest at least this (TRL's own lower bound ``1 - e`` is then at or below 0: it never
#: clips from below, and a ``c_low`` this small almost never does).
NARROWEST_FLOOR = 0.04


def _clean(value: float) -> float:
    """Rounded to 12 significant digits, so ``1 + 10 x 0.2`` is the paper's 3.0, not 3.0000000000000004."""
    return float(f"{value:.12g}")


def widening_for(epsilon: float, level: str) -> Widening:
    """The level's widening, or the token level's where the level's cannot widen ``c_low`` below the window but the
    token level's can (a sequence-level window as wide as TRL's default ``epsilon`` 0.2: the paper's path)."""
    widen = WIDENING[level]
    return widen if widen.lower_widest * epsilon < 1 or level == "token" else WIDENING["token"]


def lower_is_clamped(epsilon: float, level: str | Widening = "token") -> bool:
    """Whether the window leaves no room to widen ``c_low`` below it (``1 - W e <= 0``), so the rule clamps it."""
    widen = widening_for(epsilon, level) if isinstance(level, str) else level
    return widen.lower_widest * epsilon >= 1


def window_path(epsilon: float, epsilon_high: float | None, level: str | Widening = "token") -> dict[str, float]:
    """The ``ratio_*`` fields of the search path around the window ``[1 - epsilon, 1 + epsilon_high]`` at
    ``level`` (``"token"`` or ``"sequence"``, or a :class:`Widening` of its own); see the module doc."""
    high = epsilon if epsilon_high is None else epsilon_high
    widen = widening_for(epsilon, level) if isinstance(level, str) else level
    upper_max = 1 + widen.upper * high
    lower_max = max(1 - widen.lower_narrowest * epsilon, NARROWEST_FLOOR)
    lower_start = 1 - widen.lower_widest * epsilon if not lower_is_clamped(epsilon, widen) else lower_max / 4
    return {name: _clean(value) for name, value in dict(
        ratio_lower_start=lower_start, ratio_lower_max=lower_max,
        ratio_lower_step=(lower_max - lower_start) / (LOWER_POINTS - 1),
        ratio_upper_start=1 + high, ratio_upper_max=upper_max,
        ratio_upper_step=(upper_max - 1 - high) / (UPPER_POINTS - 1)).items()}


def derived_path(kind: str, epsilon, epsilon_high, level: str) -> tuple[dict[str, float], str]:
    """The rule for one config: the ``ratio_*`` fields and a phrase that says where they come from (the run's plan
    prints it). ``kind``: the loss type row's (``clip``, ``cap``, ``gate``); ``epsilon_high`` None is ``epsilon``,
    as TRL reads it.

    Around the user's window for the clipped losses (its ``c_high`` always the user's; ``c_low``'s widest clamped
    where the window leaves no room below it, :func:`lower_is_clamped`); around CISPO's cap (``epsilon_high``, its
    excess over 1 widened as a token-level ``c_high``; the ``c_low`` fields stay the paper's, unused by a cap); the
    paper's path for a gate (sapo, vespo: their shapes are fields of their own) and for a window ``BAPOConfig``
    refuses (a cap not above 1, an ``epsilon`` or ``epsilon_high`` not above 0)."""
    high = epsilon if epsilon_high is None else epsilon_high
    if kind == "cap" and _is_number(high) and high > 1:
        path = window_path(PAPER_EPSILON, high - 1, "token")
        return path, (f"around your CISPO cap {high}: c_high {path['ratio_upper_start']}.."
                      f"{path['ratio_upper_max']}")
    if kind != "clip":
        return dict(PAPER_PATH), f"the paper's path ({kind} loss: no clipping window of yours to start from)"
    if not (_is_number(epsilon) and _is_number(high) and 0 < high and 0 < epsilon):
        return dict(PAPER_PATH), f"the paper's path (epsilon={epsilon!r}, epsilon_high={epsilon_high!r} is no window)"
    path = window_path(epsilon, epsilon_high, level)
    if path == PAPER_PATH:
        return path, "the paper's path, BAPO around TRL's default window [0.8, 1.2]"
    clamped = (f" (your window leaves no room to widen c_low below it: its widest is clamped at "
               f"{path['ratio_lower_start']})") if lower_is_clamped(epsilon, level) else ""
    return path, (f"around your window [{_clean(1 - epsilon)}, {_clean(1 + high)}] ({level} ratios): c_high "
                  f"{path['ratio_upper_start']}..{path['ratio_upper_max']}, c_low {path['ratio_lower_start']}.."
                  f"{path['ratio_lower_max']}{clamped}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
