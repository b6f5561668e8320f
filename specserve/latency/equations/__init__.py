"""The latency model's pure math (design §2): no data, no fitting."""
