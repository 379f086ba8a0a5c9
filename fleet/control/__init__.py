"""Control: the loops that act on the fleet — rollouts, experiments, lazy loading, doctor."""
