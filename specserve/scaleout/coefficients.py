"""A fitted latency model file -> the coefficients a replica exports to the router (policy.Coefficients).

For the replica's draft length k and the acceptance E the model holds for it (measured at that k, else the
median fitted α; planning.acceptance_for), C1 and C2 are linear in the request's output length g
(C = c·p + (g/E)(c·v + k·c·d), docs/design.md §2.2), so two evaluations of the model give both lines
exactly, whatever the model's form (pooled six coefficients or one configuration's C1, C2). MoE models
are taken at full expert coverage, the load a busy replica is at.
"""
from __future__ import annotations

from specserve.scaleout.replica_choice import Coefficients


def from_model_file(path: str, k: int) -> Coefficients:
    from specserve.latency.fitting import model_file
    from specserve.latency.decisions.planning import acceptance_for

    model = model_file.load(path).model
    expected, _ = acceptance_for(model, k, None)
    p = model.prompt_tokens
    one, two = model.e2e.demands(k, expected, 1.0), model.e2e.demands(k, expected, 2.0)  # at full coverage
    slope1, slope2 = two.c1 - one.c1, two.c2 - one.c2
    return Coefficients(c1=(one.c1 - slope1, slope1), c2=(one.c2 - slope2, slope2),
                        prefill_per_token=model.prefill_per_token or 0.0, prompt_tokens=p,
                        output_tokens=model.output_tokens, k=k, acceptance_length=expected, fitted=True,
                        source=str(path))
