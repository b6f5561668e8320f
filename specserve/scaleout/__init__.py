"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint (docs/scaleout.md).

    Ray proxy (HTTP) -> OpenAIIngress (one, no model: parses, routes, retries, aggregates /health, /metrics)
                     -> EngineReplica x N (each the unchanged specserve app around its own AsyncLLMEngine)

Files: settings.py (what a deployment is made of), args.py (the `serve` flags, argparse only), hints.py
(what the router learns from a request body), replica_choice.py (the latency-model-aware choice, pure Python),
coefficients.py (a fitted model file -> the numbers a replica exports), routers.py (Ray request routers),
book.py (in-flight bookkeeping the routers and the ingress share), bridge.py (one ASGI request into the
app), replica.py, ingress.py, prometheus_merge.py, app.py (the Ray application and the Serve config
builder), launch.py (`specserve serve --replicas N`).

Nothing here is imported by the single-process server; `ray` is an optional dependency (`.[scaleout]`).
"""
