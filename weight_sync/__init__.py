"""Weight sync: the publisher in learner rank 0 and the receivers inside engine processes."""
