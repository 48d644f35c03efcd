"""Flower adapter (flwr 1.42): run the coordinator's round loop over Flower's Simulation and Deployment Engines.

* :mod:`.records` — message types and the RecordDict layout (one protobuf payload per message);
* :mod:`.transport` — :class:`~.transport.FlowerTransport` (the coordinator's Transport over a Flower Grid) and
  node -> org discovery;
* :mod:`.node` — the ClientApp's logic (which org a node is, which worker serves it);
* :mod:`.federation` — the ServerApp's logic; :mod:`.settings` — the app's run-config keys;
* :mod:`.simulation` — ``hacrl-fed simulate``.

The Flower apps themselves are ``server/app.py`` and ``client/app.py`` at the repository root. Nothing here is
imported by ``import hacrl_fed.flower``: import the submodule you need (flwr is an optional dependency).
"""
