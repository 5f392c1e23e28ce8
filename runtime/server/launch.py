"""Running the server: bind, start the engine process, serve, and shut down cleanly.

    radixlm serve --model M --port 30000          (or: python -m radixlm.runtime.server ...)

The port is bound first, so a taken port fails at once instead of after the model loads;
/health answers 503 "starting" until the engine is ready. SIGTERM (or Ctrl-C) stops accepting
connections, gives in-flight requests --shutdown-timeout seconds, aborts what is left, stops
the engine process and exits 0. A second signal aborts in-flight requests at once.
With --dp N the engine is N replicas on Ray (replica_set.py) behind the same front end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from aiohttp import web

from radixlm.runtime.engine_process.client import EngineClient
from radixlm.runtime.server.access_log import log_engine_stats
from radixlm.runtime.server.app import build_app
from radixlm.runtime.server.args import (
    CommandParser,
    ServerConfig,
    add_serve_args,
    engine_options,
    server_config,
)
from radixlm.runtime.server.sandbox import check_template, read_template
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.text_codec import TextCodec

log = logging.getLogger("radixlm.server")

_NEVER = 1e9  # seconds
STATS_LOG_INTERVAL = 10.0  # seconds between engine-stats log lines while there is work


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m radixlm.runtime.server",
                           description="radixlm HTTP server (native + OpenAI API)")
    add_serve_args(parser)
    return serve(parser.parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal; the exit code (0 after a clean shutdown)."""
    from radixlm.runtime.config.engine_config import EngineConfig

    try:
        config = server_config(args, os.environ.get("RADIXLM_API_KEY"))
        options = engine_options(args)
        EngineConfig.from_kwargs(**options)  # a bad flag fails now, not in the engine process
        if options.get("chat_template") is not None:  # not a 400 on every chat request later
            check_template(read_template(options["chat_template"]))
    except ValueError as exc:
        print(f"radixlm serve: error: {exc}", file=sys.stderr)
        return 2
    if config.dp_size > 1 and importlib.util.find_spec("ray") is None:
        print("radixlm serve: error: --dp needs Ray: pip install 'radixlm[ray]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = asyncio.run(_serve(config, options))
    if config.dp_size > 1:
        _exit_without_finalizing(code)
    return code


def _exit_without_finalizing(code: int) -> None:
    """End the process now, skipping the interpreter's teardown. With Ray loaded, that
    teardown sometimes crashes (a type freed twice while modules are cleared), so a clean stop
    would exit with SIGABRT. By now the replicas are stopped and Ray is shut down: only the
    output is left to flush."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(config: ServerConfig, options: dict[str, Any]) -> int:
    from radixlm.runtime.models.loader import DEFAULT_MODEL

    model = options.get("model")
    state = ServerState(config=config, engine=_engine_handle(config, options),
                        codec=TextCodec(None, render_timeout=config.chat_template_timeout),
                        model_name=config.served_model_name or model or DEFAULT_MODEL,
                        model_path=model)
    # keepalive_timeout also bounds how long a connection may take to send a request head:
    # aiohttp counts the connection idle until the head is complete. (Its 0 would mean "close
    # after each response"; ours means never.)
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0,
                           keepalive_timeout=config.keep_alive_timeout or _NEVER)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        await runner.cleanup()
        return 1
    host, port = runner.addresses[0][:2]
    log.info("radixlm server listening on http://%s:%d (loading the model...)", host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, state, stop)
    started = time.monotonic()
    startup = asyncio.ensure_future(_start_engine(state, options))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({startup, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if startup.done() and startup.exception() is None:
        log.info("radixlm server ready on http://%s:%d: model %s, max_model_len %d "
                 "(%.1f s to load)", host, port, state.model_name,
                 state.info.max_model_len if state.info else 0, time.monotonic() - started)
        died = asyncio.ensure_future(state.engine.died.wait())
        background = [asyncio.ensure_future(log_engine_stats(state, STATS_LOG_INTERVAL))]
        if config.watchdog_timeout > 0:
            background.append(asyncio.ensure_future(state.engine.watch(config.watchdog_timeout)))
        await asyncio.wait({stopping, died}, return_when=asyncio.FIRST_COMPLETED)
        code = 1 if died.done() else 0
        died.cancel()
        for task in background:
            task.cancel()
    elif startup.done():
        log.error("startup failed: %s", startup.exception())
        code = 1
    else:
        startup.cancel()
    stopping.cancel()
    await _shutdown(state, runner)
    log.info("radixlm server stopped")
    return code


def _engine_handle(config: ServerConfig, options: dict[str, Any]) -> Any:
    """One engine process, or (--dp N) N replicas on Ray behind the same interface."""
    if config.dp_size == 1:
        return EngineClient(options, config.log_level)
    from radixlm.runtime.replicas.replica_set import ReplicaSet

    return ReplicaSet(options, config.log_level, dp_size=config.dp_size, policy=config.router,
                      ray_address=config.ray_address, ray_host=config.ray_host)


async def _start_engine(state: ServerState, options: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    # Resolve once, here: a GGUF is converted before the engine starts, so two processes
    # never convert the same file at once, and the engine loads the resolved folder.
    folder = await loop.run_in_executor(None, _resolve, options)
    if folder is not None:
        options = {**options, "model": str(folder)}
    state.engine.options = options
    tokenizer = loop.run_in_executor(None, _load_tokenizer, folder, options)
    info = await state.engine.start()
    await loop.run_in_executor(None, state.codec.configure, await tokenizer, info.max_model_len)
    if state.codec.sandbox is not None:
        state.codec.sandbox.warm()
    state.adapters = {a["name"]: a for a in info.loras}
    state.info = info  # from here on the routes serve


def _resolve(options: dict[str, Any]) -> Path | None:
    from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS, resolve_model

    if options.get("load_format") == "dummy" and options.get("model") in ARCHITECTURE_PRESETS:
        return None  # a weight-less shape: no folder, no tokenizer
    return resolve_model(options.get("model"), options.get("revision"))


def _load_tokenizer(folder: Path | None, options: dict[str, Any]) -> Any | None:
    from radixlm.runtime.models.loader import load_tokenizer

    return load_tokenizer(folder, options.get("tokenizer"), options.get("chat_template"))


def _on_signal(state: ServerState, stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning("second signal: aborting in-flight requests now")
        state.engine.abort_all()
        return
    log.info("shutting down: no new requests; waiting up to %.0f s for %d in flight",
             state.config.shutdown_timeout, state.active_requests)
    state.draining = True
    stop.set()


async def _shutdown(state: ServerState, runner: web.AppRunner) -> None:
    state.draining = True
    for site in list(runner.sites):  # stop accepting connections
        await site.stop()
    deadline = time.monotonic() + state.config.shutdown_timeout
    while state.active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.active_requests:
        log.warning("aborting %d requests still in flight", state.active_requests)
        state.engine.abort_all()
        deadline = time.monotonic() + 5.0
        while state.active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    await runner.cleanup()
    await state.engine.close()
    state.codec.close()
