"""Several replicas' /metrics in one exposition with a replica label (specserve/scaleout/prometheus_merge.py)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specserve.scaleout.prometheus_merge import merge, with_label


def replica_text(running: float, finished: int) -> str:
    r = CollectorRegistry()
    Gauge("specserve:num_requests_running", "running", ["model_name"], registry=r).labels("m").set(running)
    c = Counter("specserve:request_success", "done", ["model_name", "finished_reason"], registry=r)
    c.labels("m", "stop").inc(finished)
    h = Histogram("specserve:e2e_request_latency_seconds", "e2e", ["model_name"], buckets=(1.0, 2.0), registry=r)
    h.labels("m").observe(1.5)
    Gauge("plain", "no labels", registry=r).set(3)
    return generate_latest(r).decode()


def test_each_family_once_with_every_replicas_samples_labelled():
    text = merge({"r0": replica_text(2, 5), "r1": replica_text(0, 7)})
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: the format is valid
    assert text.count("# TYPE specserve:num_requests_running gauge") == 1
    running = {s.labels["replica"]: s.value for s in families["specserve:num_requests_running"].samples}
    assert running == {"r0": 2.0, "r1": 0.0}
    done = {s.labels["replica"]: s.value for s in families["specserve:request_success"].samples
            if s.name.endswith("_total")}
    assert done == {"r0": 5.0, "r1": 7.0}
    buckets = [s for s in families["specserve:e2e_request_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"r0", "r1"} and len(buckets) == 6
    assert {s.labels["replica"]: s.value for s in families["plain"].samples} == {"r0": 3.0, "r1": 3.0}


def test_with_label_keeps_existing_labels_and_escapes():
    assert with_label('m{a="1"} 2', "replica", "x") == 'm{a="1",replica="x"} 2'
    assert with_label("m 2", "replica", 'q"') == 'm{replica="q\\""} 2'
    assert merge({}) == "\n"
