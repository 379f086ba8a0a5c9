"""The canary rollout: a pure state machine (``machine``), its executor (``effects``) and
the preflight checks (``preflight``)."""
