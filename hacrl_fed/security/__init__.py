"""Security: who may publish rollouts, and who may read them.

* :mod:`hacrl_fed.security.identity`: org identities (Ed25519 signing + X25519 key-agreement keys), their
  0600 key files, the pinned roster of public identities, and :func:`~hacrl_fed.security.identity.provision`.
* :mod:`hacrl_fed.security.envelope`: signed rollout batches (``sign_batch`` / ``verify_batch``,
  ``signed`` / ``verify_signed``) and :class:`~hacrl_fed.security.envelope.RejectedBatch`.
* :mod:`hacrl_fed.security.sealing`: coordinator-blind batches, response text encrypted end to end to the
  recipient orgs (``seal_batch`` / ``open_batch``).
* :mod:`hacrl_fed.security.freshness`: replay protection, the workers' challenges and the plan digest every
  batch signs, so a learner trains only on batches made for its own fresh plan (``stale_plan`` otherwise).
* :mod:`hacrl_fed.security.keys`: TLS / SuperNode-auth key material for Flower deployments.

The public signing helpers are re-exported here: ``hacrl_fed.security.sign_batch(batch, private_key) -> bytes``,
``hacrl_fed.security.verify_batch(envelope, roster, *, run_id, round) -> RolloutBatch`` and
``hacrl_fed.security.RejectedBatch`` (a ``ValueError`` whose ``reason`` and message name why).
"""

from hacrl_fed.security.envelope import RejectedBatch, sign_batch, signed, verify_batch, verify_signed

__all__ = ["RejectedBatch", "sign_batch", "signed", "verify_batch", "verify_signed"]
