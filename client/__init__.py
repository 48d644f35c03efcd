"""hacrl-fed's Flower ClientApp (component ``client.app:app``): a thin adapter to the org's policy worker."""
