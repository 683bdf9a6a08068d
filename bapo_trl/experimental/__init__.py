"""Research candidates: each a folder with its config and trainer subclass, its search, its float64 reference loop, its
tests (``tests/experimental/``) and its docs page (``docs/experimental.md``). The method (``core/``, ``trainer/``)
knows none of them: a candidate overrides one documented hook of ``BAPOTrainer``
(``_choose_window``: the window a micro-batch gets; ``_training_batch``: a generation batch as it starts training;
``loss_row``: the loss whose share is balanced).

* :mod:`.length_fair`: a window per sequence, scaled to the noise of its mean log-ratio;
* :mod:`.decoupled`: AReaL's decoupled off-policy correction (clip against the proximal policy, weight by
  ``pi_prox / pi_behaviour``);
* :mod:`.gmpo`: BAPO's search in front of TRL's experimental GMPO loss.

None beat the method's own settings in the studies (docs/results.md): they are here to be reproduced and built on,
not recommended. Their APIs may change without a deprecation period.
"""
