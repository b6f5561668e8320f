"""Fitting the model to bench records: the least-squares helpers, each fitted part (E2E, TTFT/TPOT, tails), the
assembled `LatencyModel`, its cross-validation and its file (model.json)."""
