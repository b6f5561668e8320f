"""The interpretable latency model of docs/design.md §2: L = C1/(1 − λ·C2), six SD coefficients, TTFT/TPOT/tails.

Layout (docs/latency.md has the equations): `acceptance`, `formulas`, `moe` are the pure math; `runs`,
`requests`, `saturation` read bench results; `regression`, `e2e`, `phases`, `tails`, `lengths`, `fit`,
`crossval` fit and validate; `model`, `model_file` hold a fitted model; `planning`, `report`, `plot`,
`validate` use one; `cli`/`commands` are `specserve latency`. Nothing is imported here, so that the CLI's
`--help` stays fast.
"""
