"""``bgeserve``: serve | export | build-random-model."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bgeserve.config import Settings

SHUTDOWN_ANSWER_SECS = 2.0  # after the drain deadline: time to send the 503s


def inflight_mb(settings: Settings) -> int:
    """The default allowance of request bodies in progress: an eighth of the memory the
    server may use (a body, its parsed texts and its ids take ~3-4x its size), at most 512
    MiB, at least one largest body."""
    from bgeserve.tuning import memory

    available = memory.detect_available_memory(settings.available_memory_bytes).available_bytes
    return max(settings.max_body_bytes >> 20, min(512, (available // 8) >> 20), 1)


def _serve(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os
    import signal

    import uvicorn

    from bgeserve.config import Settings
    from bgeserve.errors import BgeServeError
    from bgeserve.http.app import create_app
    from bgeserve.logs import setup_logging
    from bgeserve.runtime import select as backend
    from bgeserve.service import Service

    try:
        settings = Settings.from_env(os.environ)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    if args.bind:
        settings = settings.__class__(**{**vars(settings), "bind": args.bind})
    setup_logging(settings.log_format, settings.log_level)
    log = logging.getLogger("bgeserve")
    try:  # before any port is bound: a missing GPU EP fails fast, naming BGE_M3_EP
        settings = backend.resolve(settings, model_explicit="BGE_M3_MODEL" in os.environ,
                                   ep_explicit="BGE_M3_EP" in os.environ)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    if settings.max_inflight_mb is None:
        settings = dataclasses.replace(settings, max_inflight_mb=inflight_mb(settings))
    log.info("bgeserve starting", extra={"settings": settings.redacted()})
    if settings.warmup_only:
        from bgeserve.service.warmup import run as warmup

        return warmup(settings)
    host, _, port = settings.bind.rpartition(":")
    holder: dict[str, uvicorn.Server] = {}

    def on_fatal(exc: BaseException) -> None:
        if "server" in holder:
            holder["server"].should_exit = True

    service = Service(settings, on_fatal=on_fatal)
    app = create_app(settings, service_factory=lambda _: service)
    # uvicorn cancels the requests still running when its grace ends, answering a bare 500;
    # the service answers them 503 at BGE_M3_SHUTDOWN_TIMEOUT_SECS, so uvicorn's grace is a
    # little longer (the time to render and send those answers).
    grace = (settings.shutdown_timeout_secs + SHUTDOWN_ANSWER_SECS
             if settings.shutdown_timeout_secs else None)  # 0: no bound
    config = uvicorn.Config(app, host=host.strip("[]"), port=int(port), log_config=None,
                            timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
                            lifespan="on")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            service.begin_shutdown()
            await super().shutdown(sockets)

    server = holder["server"] = Server(config)

    def on_signal(sig: int, frame: object) -> None:
        # uvicorn handles SIGTERM/SIGINT while it runs (graceful drain), then restores these
        # handlers and re-raises the signal it caught; with the default handler the process
        # would die of it (exit -15) after a clean drain. Here it only asks for the exit.
        server.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.run()
    if service.fatal_error is not None:
        return 3
    return 0


def _probe(args: argparse.Namespace) -> int:
    """Run the startup probe in the foreground and print what it measured."""
    import dataclasses
    import os

    from bgeserve.config import Settings
    from bgeserve.engine import clamp_max_seq, model_dims
    from bgeserve.engine.forward import forward_factory
    from bgeserve.engine.tokenizer import Tokenizer
    from bgeserve.errors import BgeServeError
    from bgeserve.logs import setup_logging
    from bgeserve.model.artifacts import resolve, validate_cache_dir
    from bgeserve.runtime import select as backend
    from bgeserve.service import engine_config, probe_parts
    from bgeserve.tuning import memory, probe
    from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
    from bgeserve.tuning.tuner import HEADROOM_BYTES, chunk_timing_run, probe_table, synthetic_run

    try:
        settings = Settings.from_env(os.environ)
        setup_logging("text", settings.log_level)
        settings = backend.resolve(settings, model_explicit="BGE_M3_MODEL" in os.environ,
                                   ep_explicit="BGE_M3_EP" in os.environ)
    except BgeServeError as exc:  # a bad variable: its message, not a traceback
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    from bgeserve.service.probe_child import PIN_THRESHOLD

    memory.pin_mmap_threshold(PIN_THRESHOLD)  # measure each shape alone (see probe_child)
    artifacts = resolve(model_path=settings.model_path, variant=settings.variant,
                        cache_dir=validate_cache_dir(settings.cache_dir), offline=settings.offline)
    settings = dataclasses.replace(settings, max_seq_length=clamp_max_seq(
        settings.max_seq_length, artifacts))
    config = engine_config(settings)
    vocab = Tokenizer.load(artifacts.tokenizer_path, settings.max_seq_length).vocab_size
    before = memory.rss_bytes()
    run, close = synthetic_run(forward_factory(artifacts, config.session), vocab)
    run(1, 8)
    model_cost = memory.rss_bytes() - before
    available = memory.detect_available_memory(settings.available_memory_bytes)
    budget = memory.worker_budget(available.available_bytes, 1, model_cost,
                                  headroom=HEADROOM_BYTES, safety_factor=settings.memory_safety_factor)
    guard = CostModel(*conservative_coefficients(**model_dims(artifacts)), budget)
    print(f"model {artifacts.source}, {model_cost / 2**30:.2f} GiB loaded, "
          f"{available.available_bytes / 2**30:.1f} GiB available ({available.source}), "
          f"probe budget {budget / 2**30:.1f} GiB, threads {settings.threads_per_worker}")
    shapes = probe.default_shapes(settings.max_seq_length)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    # Chunk budgets are timed as the server's probe times them (unless the budget is pinned).
    timed = settings.max_chunk_tokens is None and config.scheduler.max_chunk_tokens is not None
    result = probe.run_probe(run, shapes=shapes,  # type: ignore[arg-type]
                             held_out=probe.default_held_out(settings.max_seq_length),
                             guard=guard, log=print,
                             chunk_candidates=probe.CHUNK_CANDIDATES if timed else (),
                             chunk_run=chunk_timing_run(run))
    close()
    print(probe_table(result))
    if result.fit is not None:
        print(f"fit: c={result.fit.c:.0f} B/run, a={result.fit.a:.0f} B/token, "
              f"b={result.fit.b:.2f} B/token^2, "
              f"held-out error {result.fit.held_out_rel_error}")
    else:
        print(f"no fit: {result.error}")
    if result.chunk_rates:
        default = config.scheduler.max_chunk_tokens
        chosen = probe.choose_chunk_tokens(default, result.chunk_rates)  # type: ignore[arg-type]
        print("chunk budgets (padded tokens: tokens/s): "
              + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(result.chunk_rates.items()))
              + f"; the server will use {chosen} (default {default})")
    if result.fit is not None and not settings.disable_probe_cache:
        parts = probe_parts(settings, artifacts)
        cache = probe.ProbeCache(settings.cache_dir / "probe-coefficients.json")
        cache.save(probe.fingerprint(parts), result.fit, parts, result.samples,
                   result.chunk_rates)
        print(f"cached in {cache.path}")
    return 0 if result.fit is not None else 1


def main(argv: list[str] | None = None) -> int:
    from bgeserve.config import Settings

    parser = argparse.ArgumentParser(prog="bgeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run the HTTP server", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the HTTP server. Configuration comes from the environment:",
        epilog=Settings.help_text())
    serve.add_argument("--bind", help="HOST:PORT (overrides BGE_M3_BIND)")
    probe_cmd = sub.add_parser("probe", help="run the memory probe now and print its table "
                               "(same environment variables as serve)")
    probe_cmd.add_argument("--shapes", help="BxS,BxS to measure instead of the default shapes")
    export = sub.add_parser("export", help="PyTorch bge-m3 → ONNX with in-graph heads")
    from bgeserve.export.main import add_arguments

    add_arguments(export)
    rand = sub.add_parser("build-random-model",
                          help="build a random-weight bge-m3 (tests, benchmarks)")
    rand.add_argument("--size", choices=["tiny", "full"], default="tiny")
    rand.add_argument("--seed", type=int, default=0)
    rand.add_argument("--vocab-size", type=int, default=None)
    rand.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "probe":
        return _probe(args)
    if args.command == "export":
        from bgeserve.export.main import run

        return run(args)
    from bgeserve.testing.randmodel import main as build

    rest = ["--size", args.size, "--seed", str(args.seed), "--out", args.out]
    if args.vocab_size:
        rest += ["--vocab-size", str(args.vocab_size)]
    return build(rest)


if __name__ == "__main__":
    sys.exit(main())
