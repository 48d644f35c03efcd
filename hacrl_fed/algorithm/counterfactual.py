"""The outcome guard's counterfactual (docs/ALGORITHM.md "Outcome guard", SECURITY.md): the learner compares its
weights with a **shadow** of itself that trains on its own rows alone, so harm that only slows its climb (a member
whose rows cost update budget without ever making the weights worse than their best) is measured against what
training alone gives, not against the learner's own best. Pure decision logic, no I/O and no tensors; the worker
(:mod:`hacrl_fed.worker.shadow`) keeps and trains the shadow and applies the verdicts.

The shadow starts from the learner's initial weights and trains each round on exactly the learner's own rows (the
same prompts and samples, re-scored under the shadow's weights as its old log-probs), never on a foreign row and
never reset to the learner's weights. At the counterfactual's checks (every ``every``-th round and the last) both
answer the same private validation prompts greedily; with the shadow's vector ``s`` as the reference of the paired
test (:func:`hacrl_fed.algorithm.outcome_guard.compare`)::

    lost   = #{p : s_p and not v_p}            gained = #{p : v_p and not s_p}

* **significantly worse than training alone** (``lost - gained > max(z * sqrt(lost + gained), margin)``): the
  learner **adopts** the shadow's weights and every foreign source it trained on since it last adopted them (or
  since the start) gets a strike (``strike``);
* **the last round, worse by more than ``last_z`` standard deviations** (``lost - gained > last_z * sqrt(lost +
  gained)``, ``last_z > 0``): the learner adopts the shadow's weights, no
  strike (a final choice between two candidates on a split neither trained on; the worker makes it on the final
  split, ``trainer.outcome_guard.final_size`` prompts apart from the validation split, which chose the learner's
  weights all run: :mod:`hacrl_fed.worker.outcome`). The bar trades the two errors: when
  the federated weights are truly better by ``d`` (``sd`` the standard deviation of ``lost - gained``) the shadow
  is taken with probability about ``Phi(-(d + last_z * sd) / sd)``, the honest cost; harm ``h`` that stayed within
  the mid-run slack is left with probability about ``Phi(last_z - h / sd)``. By the point estimate (a bar of 0,
  measured and removed after c30f784) an honest run whose gain the 400-prompt split cannot resolve loses it about
  half the time (measured: ``state``, seed 0, globex gave back 4.7 held-out points to a shadow 5 prompts better on
  the split); ``last_z = 1`` (the default) leaves at most about ``0.5 * sd`` of expected harm and almost no honest
  cost;
* otherwise nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hacrl_fed.algorithm.outcome_guard import Comparison, compare


@dataclass(frozen=True)
class CounterfactualVerdict:
    """``adopt``: the learner takes the shadow's weights; ``strike``: the foreign sources trained since the last
    adoption are blamed (only with a significant gap)."""

    comparison: Comparison
    adopt: bool
    strike: bool


def due(round: int, last_round: int, every: int) -> bool:
    """The counterfactual is checked after every ``every``-th round's update and after the last round's."""
    return round % every == 0 or round >= last_round


def against_shadow(
    shadow: Sequence[bool], current: Sequence[bool], *, z: float, margin: int, last: bool, last_z: float
) -> CounterfactualVerdict:
    """The verdict on the learner's weights (``current``) against the shadow's (``shadow``) on the same prompts
    (module doc); ``last``: this is the run's last round, where ``last_z`` is the bar."""
    cmp = compare(shadow, current, z, margin)
    if cmp.regressed:
        return CounterfactualVerdict(cmp, True, True)
    worse = cmp.lost - cmp.gained > last_z * math.sqrt(cmp.lost + cmp.gained)
    return CounterfactualVerdict(cmp, last and worse, False)
