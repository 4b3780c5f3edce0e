"""Multi-turn environments (episodes of model turns and observations) and the loop that drives them."""
