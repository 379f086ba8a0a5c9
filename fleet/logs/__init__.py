"""What the gateways recorded: the inference log, feedback and outcomes, activity."""
