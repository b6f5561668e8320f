"""`specserve serve`: the OpenAI-compatible server. Heavy imports happen inside the handler."""
from __future__ import annotations

import argparse

from specserve.engine.args import add_engine_args
from specserve.engine.config import SERVER_MAX_NUM_BATCHED_TOKENS
from specserve.scaleout.args import add_scaleout_args
from specserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TIMEOUT_READ_S
from specserve.server.tool_parsers import PARSER_NAMES
from specserve.settings import API_KEY_ENV, settings
from specserve.spec_decode.config import speculative_choice


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (SSE streaming, /metrics)",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/metrics), with speculative decoding by the shipped drafts unless told otherwise.",
        epilog="example: specserve serve --port 8000   (then: curl http://127.0.0.1:8000/v1/models); "
               "plain decoding: --speculative-config none")
    add_engine_args(p, SERVER_MAX_NUM_BATCHED_TOKENS,
                    speculative_default="with the default model, prompt lookup and the shipped drafts, lengths "
                                        "chosen per request by load; with another, none")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, 0.0.0.0 for every interface (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000,
                   help="0 picks a free port (the startup line names it) (default: %(default)s)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults (temperature, top_p, top_k, max_new_tokens) of requests that omit "
                        "them: auto: the model's generation_config.json, or its model card's for an alias; "
                        "vllm: the server's own (temperature 1, top_p 1); FOLDER: that folder's "
                        "generation_config.json (default: %(default)s)")
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_ENV}, else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the --model value)")
    g.add_argument("--max-queue", type=int, default=None,
                   help="requests allowed to wait beyond --max-num-seqs; more get 429 (default: no limit)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to let in-flight requests finish after SIGTERM (default: %(default)s)")
    g.add_argument("--disable-access-log", action="store_true", help="no per-request log lines")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 (default: %(default)s, 4 MiB)")
    g.add_argument("--timeout-read", type=float, default=DEFAULT_TIMEOUT_READ_S,
                   help="seconds a request's headers may take to arrive (after the connection opens or the "
                        "previous response ends; then the connection is closed), and its body after them "
                        "(then 408) (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    g.add_argument("--engine-stall-timeout", type=float, default=60.0,
                   help="/health answers 503 when the engine loop has died or one of its steps has run this "
                        "many seconds; an engine process hung that long is killed and restarted "
                        "(default: %(default)s)")
    g.add_argument("--engine-restarts", type=int, default=3,
                   help="engine deaths (a crash, the OOM killer, a step hung past --engine-stall-timeout) "
                        "survived within 10 minutes by starting a new engine process; one more and the server "
                        "exits non-zero. 0: exit at the first death, as vLLM does (default: %(default)s)")
    g.add_argument("--tool-call-parser", choices=PARSER_NAMES, default="auto",
                   help="the format tool calls are read from in replies to requests with tools and tool_choice "
                        "auto: hermes (<tool_call> JSON blocks: Hermes, Qwen, and specserve's default tool prompt), "
                        "llama3_json (Llama 3.1/3.2's JSON); auto: llama3_json when the chat template writes "
                        "Llama's <|python_tag|>, else hermes (default: %(default)s)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always served here")
    g.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server process instead of a process of its own "
                        "(the HTTP side then competes with the step loop for the GIL and the cores)")
    add_scaleout_args(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    import logging

    from specserve.errors import SpecServeError

    if not 0 <= args.port <= 65535:
        raise SpecServeError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue is not None and args.max_queue < 0:
        raise SpecServeError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.drain_timeout < 0:
        raise SpecServeError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.engine_restarts < 0:
        raise SpecServeError(f"--engine-restarts must be >= 0, got {args.engine_restarts}")
    for flag in ("max_request_bytes", "timeout_read", "timeout_keep_alive", "engine_stall_timeout"):
        if not getattr(args, flag) > 0:
            raise SpecServeError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    import prometheus_client
    # One `_created` timestamp series per counter and histogram is noise for a scraper (vLLM drops them
    # too). Process-wide, so it is switched off here in the server process, not in the library.
    prometheus_client.disable_created_metrics()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("specserve.server")
    if args.replicas is not None:  # N engines on Ray Serve (specserve/scaleout/)
        from specserve.server.generation_config import resolve
        log.info(resolve(args.generation_config, args.model)[1])  # a bad folder fails here, before Ray starts
        from specserve.scaleout.launch import serve_replicas
        args.speculative_config, why = speculative_choice(args.speculative_config, args.model)
        log.info(why)
        args.api_key = args.api_key or settings.api_key
        return serve_replicas(args)

    from specserve.server import launch

    sock = launch.bind(args.host, args.port)  # a taken port fails now, not after loading the model
    started = None
    try:
        from specserve.engine.args import engine_config_kwargs
        from specserve.engine.engine_loop import start_engine_process

        args.speculative_config, why = speculative_choice(args.speculative_config, args.model)
        log.info(why)
        # The engine process imports torch and loads the model while this one imports the server and checks
        # the same configuration: the two startups overlap instead of adding up (docs/design.md §5.1).
        flags = engine_config_kwargs(args)
        started = None if args.engine_thread else start_engine_process(flags)
        from specserve.engine.config import EngineConfig
        config = EngineConfig(**flags)  # a bad flag fails here (and stops that process)
        from specserve.engine.async_engine import AsyncLLMEngine
        from specserve.server.app import build_app
        from specserve.server.generation_config import resolve

        sampling_defaults, why = resolve(args.generation_config, args.model)
        log.info(why)
        engine = AsyncLLMEngine(config, stall_timeout=args.engine_stall_timeout, process=not args.engine_thread,
                                max_restarts=args.engine_restarts, started=started)
        started = None  # the engine owns its process now
        app = build_app(engine, args.served_model_name or [args.model], args.api_key or settings.api_key,
                        args.max_queue, max_request_bytes=args.max_request_bytes, timeout_read=args.timeout_read,
                        sampling_defaults=sampling_defaults, tool_call_parser=args.tool_call_parser)
        launch.run(app, engine, sock, args.drain_timeout, access_log=not args.disable_access_log,
                   timeout_keep_alive=args.timeout_keep_alive, timeout_read=args.timeout_read)
    finally:
        sock.close()
        if started is not None:  # startup failed before the engine took its process
            started[0].terminate()
    return 0
