"""The command line (TRL's script pattern, as ``trl/scripts/``): the ``bapo`` command (``main``: its subcommands
``train``, ``serve``, ``evaluate``, ``plot``, ``models``), ``train_bapo.py``'s job (``train``, also ``bapo train``),
its datasets (``data``), the reward registry (``rewards``), the run summary (``summary``) and what a launch really
did (``launch_info``). The trainer imports nothing from here."""
