"""``bapo plot RUN_DIR [RUN_DIR ...] -o dynamics.png [--labels a b] [--target 0.5]`` (or ``python -m
bapo_trl.cli.plot``, the same command): parses and calls :func:`bapo_trl.reporting.dynamics.plot_dynamics`, which draws
the figure (see there for what is read and drawn)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..reporting.dynamics import DPI, LOG_HISTORY_NAME, load_run, plot_dynamics  # noqa: F401


def main(argv: Sequence[str] | None = None, prog: str = "python -m bapo_trl.cli.plot") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plot the training dynamics of BAPO runs (reward, entropy, clip bounds, positive share, clip "
        "fractions, staleness, replay and partial rollout when logged) into one PNG; several runs are overlaid.",
    )
    parser.add_argument("runs", nargs="+", help="run directories or trainer_state.json / bapo_log_history.json files")
    parser.add_argument("-o", "--output", default="dynamics.png", help="PNG to write (default: dynamics.png)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: directory names)")
    parser.add_argument("--target", type=float, help="positive-share target rho0 (default: stored with the run)")
    parser.add_argument("--smooth", type=int, help="rolling-mean window in logged points (1 = none; default ~5%%)")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.runs)} runs.")
    if args.smooth is not None and args.smooth < 1:
        parser.error(f"--smooth must be >= 1 logged point (1 = none), got {args.smooth}.")
    try:
        fig = plot_dynamics(args.runs, output=args.output, labels=args.labels, target=args.target, smooth=args.smooth)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    except OSError as err:  # the PNG's path: a directory, or a folder that does not exist or cannot be written
        parser.error(f"-o/--output {args.output!r}: {err.strerror or err}.")
    width, height = (fig.get_size_inches() * DPI).round().astype(int)
    print(f"wrote {args.output} ({width}x{height} px; panels: {', '.join(fig.bapo_panels)})")
    from ..core.entropy_clip import predicted_vs_realised

    for label, run in zip(args.labels or args.runs, args.runs):
        corr, pairs = predicted_vs_realised(load_run(run)["log_history"])
        if pairs:
            print(f"{label}: Entropy-Clip Rule, correlation of the predicted change with the realised change of "
                  f"entropy over {pairs} logged steps: {corr:.3f}")
    return 0


def command(argv: list[str] | None = None, prog: str = "python -m bapo_trl.cli.plot") -> int:
    """``bapo plot``'s contract (:mod:`.main`): ``main`` parses ``argv`` and returns the exit code."""
    return main(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(command())
