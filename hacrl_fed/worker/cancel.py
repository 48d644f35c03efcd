"""Cooperative cancellation now lives in :mod:`hacrl_fed.cancel` (below ``engines/``, ``wire/`` and ``worker/``);
this name stays for the code that still imports it from here."""

from hacrl_fed.cancel import CallCancelled, cancel_scope, cancelled, raise_if_cancelled

__all__ = ["CallCancelled", "cancel_scope", "cancelled", "raise_if_cancelled"]
