"""An organization's worker as several ranks of one ``torch.distributed`` group behind its one endpoint (issue 28).

Endpoint side: :mod:`~hacrl_fed.sharded.group` (torchrun's environment, the process group, the rank store),
:mod:`~hacrl_fed.sharded.dispatch` (rank 0 hands each request to every rank), :mod:`~hacrl_fed.sharded.watchdog`
(heartbeats; a rank that dies, hangs or runs out of memory fails the reply naming it) and
:mod:`~hacrl_fed.sharded.endpoint` (``hacrl-fed worker`` under torchrun). docs/ARCHITECTURE.md "An org on
several ranks".
"""
