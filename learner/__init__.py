"""The learner: training engines, losses, the training loop, checkpoints."""
