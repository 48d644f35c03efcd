"""An example of a task and a reward function that live outside hacrl-fed (see docs/BRING_YOUR_OWN.md)."""
