"""The canary rollout: a pure state machine (``machine``), what a tick reads and how it is
judged (``reading``), its executor (``effects``) and the preflight checks (``preflight``)."""
