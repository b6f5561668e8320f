"""The interpretable latency model of docs/design.md §2: L = C1/(1 − λ·C2), six SD coefficients, TTFT/TPOT/tails.

Grouped by job, each group importing only those before it (docs/latency.md has the equations):
    equations/  the pure math: acceptance E(α, k), the SD formulas, arrival regularity, MoE coverage, lengths
    records/    `specserve bench` runs and their per-request rows, and which runs are past saturation
    fitting/    least squares, each fitted part (E2E, TTFT/TPOT phases, tails), the assembled model,
                cross-validation and model.json
    decisions/  what a fitted model decides: best k, break-even, capacity plans, plain-language reports, plots
    cli.py, commands.py   `specserve latency ...`
Nothing is imported here, so that the CLI's `--help` stays fast.
"""
