"""The command line (TRL's script pattern, as ``trl/scripts/``): ``train_bapo.py``'s job (``train``), its datasets
(``data``), the reward registry (``rewards``), the run summary (``summary``) and what a launch really did
(``launch_info``). The trainer imports nothing from here."""
