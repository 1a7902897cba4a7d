"""``bgeserve``: serve | export | build-random-model."""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal

    import uvicorn

    from .config import Settings
    from .errors import BgeServeError
    from .http.app import create_app
    from .logs import setup_logging
    from .service import Service

    try:
        settings = Settings.from_env(os.environ)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    if args.bind:
        settings = settings.__class__(**{**vars(settings), "bind": args.bind})
    setup_logging(settings.log_format, settings.log_level)
    log = logging.getLogger("bgeserve")
    log.info("bgeserve starting", extra={"settings": settings.redacted()})
    host, _, port = settings.bind.rpartition(":")
    holder: dict[str, uvicorn.Server] = {}

    def on_fatal(exc: BaseException) -> None:
        if "server" in holder:
            holder["server"].should_exit = True

    service = Service(settings, on_fatal=on_fatal)
    app = create_app(settings, service_factory=lambda _: service)
    config = uvicorn.Config(app, host=host.strip("[]"), port=int(port), log_config=None,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_secs) or None,
                            lifespan="on")
    server = holder["server"] = uvicorn.Server(config)

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


def main(argv: list[str] | None = None) -> int:
    from .config import Settings

    parser = argparse.ArgumentParser(prog="bgeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run the HTTP server", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the HTTP server. Configuration comes from the environment:",
        epilog=Settings.help_text())
    serve.add_argument("--bind", help="HOST:PORT (overrides BGE_M3_BIND)")
    export = sub.add_parser("export", help="PyTorch bge-m3 → ONNX with in-graph heads")
    from .export.main import add_arguments

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
    if args.command == "export":
        from .export.main import run

        return run(args)
    from .testing.randmodel import main as build

    rest = ["--size", args.size, "--seed", str(args.seed), "--out", args.out]
    if args.vocab_size:
        rest += ["--vocab-size", str(args.vocab_size)]
    return build(rest)


if __name__ == "__main__":
    sys.exit(main())
