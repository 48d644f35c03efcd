"""What a round's plan is made of and checked against, shared by the coordinator and every worker (it imports
neither): :mod:`.sampler` (which prompts a round uses, the fixed held-out ids) and :mod:`.screening` (the checks
of an org's rollout batch against its plan, run at the coordinator and again at each receiving worker)."""
