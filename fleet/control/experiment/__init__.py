"""The A/B experiment: a pure state machine over its looks (``machine``) and its executor
(``effects``: reads the counters, outcomes and stop requests, stores the state, routes)."""
