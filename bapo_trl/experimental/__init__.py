"""Research candidates: each a folder with its config and trainer subclass, its search, its float64 reference loop, its
tests (``tests/experimental/``) and its docs page (``docs/experimental.md``). The method (``core/``, ``trainer/``)
knows none of them: a candidate overrides one documented hook of ``BAPOTrainer``
(``_choose_window``: the window a micro-batch gets; ``_training_batch``: a generation batch as it starts training;
and its config's ``loss_row``: the loss whose share is balanced).

* :mod:`.length_fair`: a window per sequence, scaled to the noise of its mean log-ratio;
* :mod:`.decoupled`: AReaL's decoupled off-policy correction (clip against the proximal policy, weight by
  ``pi_prox / pi_behaviour``);
* :mod:`.gmpo`: BAPO's search in front of TRL's experimental GMPO loss.

None beat the method's own settings in the studies (docs/results.md): they are here to be reproduced and built on,
not recommended. Their APIs may change without a deprecation period.
"""

import os
import warnings


class BAPOExperimentalWarning(UserWarning):
    """Importing :mod:`bapo_trl.experimental` (as TRL's ``trl.experimental`` warns with its own category)."""


#: Set to silence the warning below (as TRL's ``TRL_EXPERIMENTAL_SILENCE``).
SILENCE_ENV = "BAPO_TRL_EXPERIMENTAL_SILENCE"

if not os.environ.get(SILENCE_ENV):
    warnings.warn("You are importing from 'bapo_trl.experimental': research candidates that did not beat the method. "
                  "Their APIs may change or be removed without notice. Silence this warning by setting environment "
                  f"variable {SILENCE_ENV}=1.", BAPOExperimentalWarning, stacklevel=2)
