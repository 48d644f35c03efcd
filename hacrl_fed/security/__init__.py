"""Security: who may publish rollouts, and who may read them.

* :mod:`hacrl_fed.security.identity`: org identities (Ed25519 signing + X25519 key-agreement keys), their
  0600 key files, the pinned roster of public identities, and :func:`~hacrl_fed.security.identity.provision`.
* :mod:`hacrl_fed.security.envelope`: signed rollout batches (``sign_batch`` / ``verify_batch``,
  ``signed`` / ``verify_signed``) and :class:`~hacrl_fed.security.envelope.RejectedBatch`.
* :mod:`hacrl_fed.security.sealing`: coordinator-blind batches, response text encrypted end to end to the
  recipient orgs (``seal_batch`` / ``open_batch``).
* :mod:`hacrl_fed.security.keys`: TLS / SuperNode-auth key material for Flower deployments.

Submodules are imported on use (nothing is re-exported here), so importing one does not pull in the others.
"""
