"""Analysis: pure verdicts over what was served — canary, sequential, A/B, drift, quality,
monitoring — and ``sources``, the readers of what the gateways counted."""
