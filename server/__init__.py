"""hacrl-fed's Flower ServerApp (component ``server.app:app``): drives the coordinator over Flower."""
