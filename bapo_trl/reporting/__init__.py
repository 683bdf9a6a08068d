"""A run's results, as a user reads them: the dynamics figure (``dynamics.py``), the text summary and the list of
saved files (``summary.py``), and the callback that writes them at the end of training (``callbacks.py``). A layer
above the trainer (it reads the trainer's card and checkpoint helpers; the trainer imports none of it): ``bapo
train``, ``bapo plot`` and the package face take these from here."""
