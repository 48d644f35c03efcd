"""Security tooling: TLS / SuperNode-auth key material for Flower deployments (:mod:`hacrl_fed.security.keys`)."""
