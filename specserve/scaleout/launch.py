"""`specserve serve --replicas N`: start (or join) Ray, run the application, serve until SIGTERM/SIGINT.

Like the single-process server it prints `specserve serving http://HOST:PORT/v1 | ...` once every replica
is up, and exits 0 after a signal, having shut down what it started: Serve and the local Ray cluster,
or, on a cluster it joined (--ray-address), only its own application.

Who answers HTTP (`--front`): by default this process, under uvicorn, calling the replicas through a Ray
deployment handle: the request router runs here, and each request and each streamed piece crosses one Ray
hop. `--front ray` deploys the ingress as a Ray Serve deployment behind Ray's HTTP proxy instead (what a
Serve config file deploys): proxy -> ingress -> replica, two hops, and the proxy's process besides.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
from pathlib import Path

import uvicorn

from specserve.errors import SpecServeError
from specserve.scaleout.settings import APP_NAME, ScaleoutSettings

log = logging.getLogger("specserve.scaleout")
RAY_MISSING = ("--replicas needs Ray Serve, which is not installed: pip install 'specserve[scaleout]' "
               "(or 'ray[serve]>=2.40')")
RAY_FAILED = "Ray could not start a local cluster"  # tests skip on this line: no Ray on that machine


def free_port(host: str, port: int) -> int:
    """`port`, checked free now (a taken port fails before the model loads), or a free one for 0. Ray binds
    it itself, a moment later, while its own processes bind ports the kernel hands out (port 0, the
    ephemeral range) and its workers take 10002-19999: so a port for 0 comes from between the two, where
    none of Ray's can take it in between (one from the ephemeral range once lost that race in CI)."""
    candidates = [port] if port else random.sample(range(20000, _ephemeral_start()), 64) + [0]
    for candidate in candidates:
        try:
            with socket.socket(socket.getaddrinfo(host, candidate, type=socket.SOCK_STREAM)[0][0]) as s:
                s.bind((host, candidate))
                return s.getsockname()[1]
        except OSError as e:
            if port:
                raise SpecServeError(f"cannot listen on {host}:{port}: {e}") from None
    raise SpecServeError(f"cannot listen on {host}: no free port")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return max(20001, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def start_ray(address: str | None, s: ScaleoutSettings) -> bool:
    """Connect to `address`, or start a local cluster sized for the replicas; True if we started it."""
    import ray

    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    cores = os.cpu_count() or 1
    wanted = s.replicas * s.num_threads
    if wanted > cores:
        log.warning("%d replicas x %d threads = %d threads on %d cores: they will slow each other down",
                    s.replicas, s.num_threads, wanted, cores)
    try:
        # Logical CPUs: at least what the replicas reserve, so an oversubscribed local run still starts.
        ray.init(num_cpus=max(cores, wanted), include_dashboard=False, log_to_driver=True)
    except Exception as e:  # noqa: BLE001 - any failure here means no Ray on this machine
        raise SpecServeError(f"{RAY_FAILED}: {type(e).__name__}: {e}") from None
    return True


class _Front(uvicorn.Server):
    """uvicorn for the process front: a signal stops it after its requests finish (up to the drain
    timeout) without being raised again once it has stopped (uvicorn's default), so Serve and Ray can be
    shut down after it."""

    def handle_exit(self, sig, frame) -> None:
        self.force_exit = self.should_exit  # a second signal: stop now
        self.should_exit = True


def serve_front(s: ScaleoutSettings, args, sock: socket.socket, handle) -> None:
    from specserve.scaleout.ingress import Ingress
    from specserve.server.launch import timed_protocol

    sock.listen(2048)
    config = uvicorn.Config(Ingress(handle, s.to_dict()).api(), lifespan="off", log_level="info",
                            access_log=not args.disable_access_log, timeout_graceful_shutdown=s.drain_timeout,
                            timeout_keep_alive=s.timeout_keep_alive, http=timed_protocol(s.timeout_read))
    _Front(config).run(sockets=[sock])


def describe(s: ScaleoutSettings, url: str) -> str:
    e = s.engine
    spec = e.get("speculative_config") or "none"
    model = s.latency_model or "none (in-flight work by length)"
    return (f"specserve serving {url}/v1 | {s.replicas} replica(s) on Ray Serve, {s.num_threads} thread(s) each | "
            f"front {s.front} | router {s.router} | latency model {model} | model {e['model']} | draft {spec} | "
            f"max_num_seqs {e['max_num_seqs']}")


def serve_replicas(args) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        raise SpecServeError(RAY_MISSING) from None
    from specserve.scaleout.app import build_application, engine_application

    s = ScaleoutSettings.from_args(args)
    if s.front == "process":
        from specserve.server.launch import bind
        sock = bind(args.host, args.port)  # held from now on: none of Ray's processes can take it
        port = sock.getsockname()[1]
    else:
        sock, port = None, free_port(args.host, args.port)
    stop = threading.Event()

    def on_signal(*_):
        stop.set()

    def catch_signals():
        # Not the default handlers: dying on SIGTERM would skip the shutdown below and leave Ray running.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    catch_signals()
    started_ray = start_ray(args.ray_address, s)
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        catch_signals()  # again: ray.init may install its own
        if sock is not None:
            serve.start(proxy_location="Disabled")
            handle = serve.run(engine_application(s), name=APP_NAME, route_prefix=None)
            log.info(describe(s, f"http://{host}:{port}"))
            if not stop.is_set():
                serve_front(s, args, sock, handle)  # until a signal, after which its requests finish
        else:
            serve.start(http_options={"host": args.host, "port": port,
                                      "keep_alive_timeout_s": max(1, round(s.timeout_keep_alive))})
            serve.run(build_application(s), name=APP_NAME, route_prefix="/")
            log.info(describe(s, f"http://{host}:{port}"))
            stop.wait()
        log.info("stopping: draining replicas for up to %g s", s.drain_timeout)
    finally:
        if sock is not None:
            sock.close()
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)
    return 0
