"""Usage and cost: the records gateways write, the meter that writes them, prices, the rollup."""
