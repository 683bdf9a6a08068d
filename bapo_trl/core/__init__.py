"""The method, as pure tensor functions with the paper's names; imports torch and nothing of TRL.

* ``clipping.py``: BAPO's bound search (Algorithm 1 and the official code's variant) and the positive share;
  ``clipping_reference.py``: the plain loops it is tested and benchmarked against (the trainer never imports them);
* ``loss_types.py``: one row per TRL loss type (the ratios it clips, how the window reaches its loss, the share the
  search balances); ``gates.py``: the soft gates of ``sapo`` and ``vespo``;
* ``metrics.py``: every logged metric as a pure function, and the registry of their names; ``entropy_clip.py``: the
  Entropy-Clip Rule diagnostics;
* ``numerics.py``: finite inputs for the loss; ``target_controller.py``: the closed-loop target (experimental);
* ``window_rule.py``: the search path derived from the user's clipping window (``BAPOConfig``'s unset ``ratio_*``);
  ``loss_checks.py``: what each loss type's row refuses or warns of in a config;
* ``lazy.py``: how the package's ``__init__`` modules load a name on first use.
"""
