"""The Ray Serve applications: N EngineReplica deployments, alone or behind one OpenAIIngress deployment.

`engine_application(settings)` is what `specserve serve --replicas N` runs (its own process answers HTTP,
launch.py); `build_application(settings)` adds the ingress deployment behind Ray's HTTP proxy (`--front
ray`), and `app_builder` is that for a Serve config file on an existing Ray cluster (docs/scaleout.md):

    applications:
      - name: specserve
        route_prefix: /
        import_path: specserve.scaleout.app:app_builder
        args: {model: smollm2-135m, replicas: 2, num_threads: 4, router: latency}
"""
from __future__ import annotations

from specserve.scaleout.settings import ScaleoutSettings

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
INGRESS_MAX_ONGOING = 100_000  # the ingress only waits on replicas: it should never be what queues


def engine_application(s: ScaleoutSettings):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specserve.scaleout.replica import EngineReplica
    from specserve.scaleout.routers import ROUTER_CLASSES

    router = RequestRouterConfig(request_router_class=ROUTER_CLASSES[s.router],
                                 request_router_kwargs={"session_imbalance": s.session_imbalance},
                                 request_routing_stats_period_s=s.stats_period_s)
    # num_cpus reserves the replica's threads, so Ray places replicas where their cores are free.
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=s.replicas,
                              ray_actor_options={"num_cpus": s.num_threads, "num_gpus": s.gpus_per_replica},
                              max_ongoing_requests=s.ongoing_cap, graceful_shutdown_timeout_s=s.drain_timeout,
                              request_router_config=router)
    return engine.bind(s.to_dict())


def build_application(s: ScaleoutSettings):
    from ray import serve

    from specserve.scaleout.ingress import OpenAIIngress

    ingress = serve.deployment(OpenAIIngress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING)
    return ingress.bind(engine_application(s), s.to_dict())


def app_builder(args: dict):
    """For `serve run` / `serve deploy` with `import_path: specserve.scaleout.app:app_builder`: `args` are
    the `specserve serve` flags as keys (model, replicas, num_threads, router, latency_model, ...)."""
    from specserve.model.registry import DEFAULT_MODEL
    from specserve.spec_decode.config import speculative_choice

    s = ScaleoutSettings.from_dict(dict(args or {}))
    # The same speculative default as `specserve serve`: the shipped drafts with the default model.
    s.engine["speculative_config"], _ = speculative_choice(s.engine.get("speculative_config"),
                                                            s.engine.get("model", DEFAULT_MODEL))
    return build_application(s)
