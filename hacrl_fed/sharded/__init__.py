"""An organization's policy worker as ``N`` ranks of one ``torch.distributed`` group (issue 28).

The worker side lives here: :mod:`hacrl_fed.sharded.fsdp` (FSDP2 wrapping of a model, collectives over Python
objects), :mod:`hacrl_fed.sharded.trainer` (the global update over the ranks' shares of the rows),
:mod:`hacrl_fed.sharded.generation` (the round's engine batches over the ranks), :mod:`hacrl_fed.sharded.checkpoint`
and :mod:`hacrl_fed.sharded.dcp_files` (sharded checkpoints, read at any ``N``) and :mod:`hacrl_fed.sharded.worker`
(:class:`~hacrl_fed.sharded.worker.ShardedPolicyWorker`, the collective counterpart of
:class:`~hacrl_fed.worker.policy_worker.PolicyWorker`). The worker's methods but ``health`` are collective: the
process group is initialised by the caller, and every rank calls the same method with the same request in the
same order.

The endpoint side: :mod:`~hacrl_fed.sharded.group` (torchrun's environment, the process group, the rank store),
:mod:`~hacrl_fed.sharded.dispatch` (rank 0 hands each request to every rank), :mod:`~hacrl_fed.sharded.watchdog`
(heartbeats; a rank that dies, hangs or runs out of memory fails the reply naming it) and
:mod:`~hacrl_fed.sharded.endpoint` (``hacrl-fed worker`` under torchrun). docs/ARCHITECTURE.md "An org on
several ranks".
"""
