"""Running hacrl-fed on a real Flower deployment: the local process harness (:mod:`hacrl_fed.deploy.harness`)."""
