"""Serve a model over an OpenAI-compatible HTTP API.

    python -m paddle_step.serve --model path/to/checkpoint [--host 127.0.0.1 --port 8000]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. The model id is the checkpoint
folder's name unless ``--served-model-name`` says otherwise; the engine flags are
``examples/generate.py``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from ...engine.arg_utils import (
    add_engine_arguments,
    check_engine_arguments,
    load_tokenizer,
)
from ...engine.core_client import EngineLoop

__all__ = ["build_app", "main", "missing_serving_packages", "parse_args"]

# The serving stack (requirements.txt): module -> distribution to pip-install.
SERVING_PACKAGES = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
}


def missing_serving_packages() -> list[str]:
    """The distributions of the serving stack that cannot be imported."""
    return [
        dist
        for module, dist in SERVING_PACKAGES.items()
        if importlib.util.find_spec(module) is None
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m paddle_step.serve", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id in the API (default: the checkpoint folder's name)",
    )
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    check_engine_arguments(parser, args)
    return args


def build_app(args: argparse.Namespace):
    """``(app, loop)``: the engine started in its own process (``loop``), and the FastAPI
    app over it, which stops it on shutdown. Raises ``ValueError`` for flags or a
    checkpoint the engine cannot run."""
    from .api_server import create_app

    tokenizer = load_tokenizer(args)  # the engine process loads the model
    loop = EngineLoop(args)
    try:
        loop.start()
    except RuntimeError as error:
        raise ValueError(str(error)) from None
    name = args.served_model_name or loop.info["name"]
    print(
        f"paddle_step.serve: model {name}, {loop.info['threads']} CPU threads per engine",
        file=sys.stderr,
    )
    return create_app(loop, tokenizer, name), loop


def main(argv: list[str] | None = None) -> None:
    missing = missing_serving_packages()
    if missing:
        raise SystemExit(
            f"paddle_step.serve: the serving stack is not installed ({', '.join(missing)}); "
            f"run `{sys.executable} -m pip install {' '.join(missing)}`"
        )
    args = parse_args(argv)
    # With --tp > 1 (under paddle.distributed.launch) rank 0 serves HTTP; every rank runs
    # an engine process, and rank 0's hands the others each batch of requests.
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0")) if args.tp > 1 else 0
    try:
        if rank == 0:
            app, _loop = build_app(args)
        else:
            follower = EngineLoop(args)
            follower.start()
    except (ValueError, RuntimeError) as error:  # a checkpoint or budget it cannot run
        raise SystemExit(f"paddle_step.serve: {error}") from None
    if rank != 0:
        follower.wait()
        return
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
