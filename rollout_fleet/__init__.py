"""The rollout fleet: engine servers and the workers that drive them."""
