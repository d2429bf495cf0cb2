"""``shmtransport vllm-worker``: vLLM's engine (AsyncLLM) behind our ``Generator`` service, fed
from the daemon's arena without copies up to the model.

It wraps the engine the way SMG's stock servicer does (preprocessed multimodal inputs go straight to
``AsyncLLM.generate`` as a ``mm_input``; vLLM's HF processor is bypassed), but reads the tensors
differently:

- stock servicer: per tensor ``pread`` of a file (copy 1) into a ``bytearray`` (copy 2), floats cast
  to the model dtype (copy 3), and the file unlinked: one file per tensor.
- here: one Acquire for the whole request; each tensor is a zero-copy view of the arena on private
  copy-on-write pages (an in-place op in vLLM or a model stays in this process, never SIGSEGV);
  the item's identity is recomputed from those bytes and checked before the engine sees it; tensors
  keep their dtype (vLLM's model casts on the device; raw uint8 pixels are never cast anyway).

Two ways to hand the tensors to vLLM (``--model-inputs``):

- ``handles`` (default): vLLM gets items that carry the handles (``handle_items``); its EngineCore
  forwards them and the process where the model runs maps the arena (``model_worker``, installed as
  the engine's ``--worker-cls``), so vLLM's ZMQ socket and broadcast ring carry no tensor bytes.
  This process holds the request's leases until it is over (``ABORT_GRACE_S`` longer if it ends
  early).
- ``views``: vLLM gets the views and copies the bytes itself (a kernel copy into and out of its ZMQ
  socket to the EngineCore, then its broadcast ring to the workers); the leases are released once
  the request is handed over, each deferred by the client until vLLM drops its last view. With
  ``--mm-processor-cache-type shm`` the items go into vLLM's own ring (``inject_into_mm_cache``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any, AsyncIterator, Callable, NoReturn, cast

import grpc

from ..client import Consumer
from ..error_boundary import AioErrorBoundary
from ..errors import InvalidArgument, ShmTransportError
from ..protocol import sampling as sampling_mod
from ..protocol.capabilities import server_info
from ..protocol.items import FieldConfig
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..socket_lock import claim_socket, unix_socket_path
from ..v1 import generate_pb2 as gpb
from ..v1 import generate_pb2_grpc as gpb_grpc
from ..worker.request import EngineInputs, open_request
from . import environment, model_worker
from .handle_items import handle_item

DESCRIPTION = "vLLM's engine behind the Generator service, fed zero-copy from shmtransport's arena"
ABORT_GRACE_S = 10.0  # how long the leases of a request that ended early outlive it (see VllmGeneratorService)
_FINISH = {"length": gpb.FINISH_REASON_LENGTH, "stop": gpb.FINISH_REASON_STOP}
_UnaryContext = grpc.aio.ServicerContext[gpb.GenerateRequest, gpb.GenerateResponse]
# GenerateStream also runs under Generate's (unary) context
_StreamContext = grpc.aio.ServicerContext[gpb.GenerateRequest, gpb.GenerateStreamChunk] | _UnaryContext


def vllm_field(config: FieldConfig) -> Any:
    """Our FieldConfig -> vLLM's field object (the one an item's element carries)."""
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFlatField, MultiModalSharedField

    if config.kind == "batched":
        return MultiModalBatchedField(keep_on_cpu=config.keep_on_cpu)
    if config.kind == "flat":
        return MultiModalFlatField(slices=list(config.slices), dim=config.dim, keep_on_cpu=config.keep_on_cpu)
    return MultiModalSharedField(batch_size=config.batch_size, keep_on_cpu=config.keep_on_cpu)


def engine_prompt(prompt_token_ids: list[int], inputs: EngineInputs, *,
                  handles_to_model: bool = False) -> dict[str, Any]:
    """``EngineInputs`` (zero-copy views) -> vLLM's ``mm_input``. ``handles_to_model``: the
    shared-memory tensors the model reads on its device go as handles (``handle_items``), for
    ``model_worker`` to resolve where the model runs; otherwise as the views themselves."""
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import (
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    items: dict[str, list[Any]] = {}
    placeholders: dict[str, list[Any]] = {}
    for modality, kw_list in inputs.mm_kwargs.items():
        items[modality] = []
        for kw, fields, handles in zip(kw_list, inputs.mm_fields[modality], inputs.mm_handles[modality]):
            vfields = {key: vllm_field(fields[key]) for key in kw}
            items[modality].append(
                handle_item(kw, vfields, handles) if handles_to_model
                else MultiModalKwargsItem({key: MultiModalFieldElem(data=tensor, field=vfields[key])
                                           for key, tensor in kw.items()}))
        placeholders[modality] = [PlaceholderRange(offset=p.offset, length=p.length, is_embed=p.is_embed)
                                  for p in inputs.mm_placeholders[modality]]
    hashes = {m: list(h) for m, h in inputs.mm_hashes.items()}
    missing = [m for m in items if len(hashes.get(m, ())) != len(items[m])]
    if missing:  # vLLM keys its caches on these and trusts them: never make one up
        raise InvalidArgument(f"every item needs its identity (mm_hash) for vLLM; missing for {missing}")
    # vLLM's mm_input builds a TypedDict (MultiModalInputs): a dict of str keys
    return cast("dict[str, Any]", mm_input(prompt_token_ids=prompt_token_ids, mm_kwargs=MultiModalKwargsItems(items),
                                           mm_hashes=hashes, mm_placeholders=placeholders))


def sampling_params(request: gpb.GenerateRequest) -> Any:
    """vLLM's ``SamplingParams`` for ``request`` (delta outputs); InvalidArgument for a sampling mask."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    projected = sampling_mod.project_sampling(request)
    if projected.return_sampling_mask:
        raise InvalidArgument("response.return_sampling_mask is not served by the vLLM worker")
    kwargs = dict(projected.kwargs)
    return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA, detokenize=bool(kwargs.get("stop")))


class VllmGeneratorService(gpb_grpc.GeneratorServicer):
    """Generate / GenerateStream / GetServerInfo over an AsyncLLM.

    ``handles_to_model``: the engine's worker class is ``model_worker.HandleResolvingWorker``; the
    tensors go to it as handles, and this process keeps its own leases until the request is over
    (``ABORT_GRACE_S`` longer when it ends early: a step already on its way to the model may still
    acquire them)."""

    def __init__(self, engine: Any, consumer: Consumer, *, verify: str = "always",
                 limits: Limits = DEFAULT_LIMITS, handles_to_model: bool = False) -> None:
        self.engine = engine
        self.consumer = consumer
        self.verify = verify
        self.limits = limits
        self.handles_to_model = handles_to_model
        self.inject_into_shm_cache = not handles_to_model and _processor_cache_type(engine) == "shm"
        self._info = server_info(limits, native_generate=True)

    async def GetServerInfo(self, request: gpb.ServerInfoRequest,
                            context: grpc.aio.ServicerContext[gpb.ServerInfoRequest, gpb.ServerInfo]) -> gpb.ServerInfo:
        """What this server accepts and does (limits, adapters, native Generate)."""
        return self._info

    def _prepare(self, request: gpb.GenerateRequest) -> tuple[dict[str, Any], Any, EngineInputs | None]:
        """Off the event loop: validate, acquire (one RPC), verify identities, build vLLM's input;
        the inputs whose leases stay held while the engine runs (None: nothing to hold)."""
        prompt = sampling_mod.prompt_token_ids(request)
        params = sampling_params(request)
        for name in ("lora_name", "cache_salt"):
            if request.HasField(name):
                raise InvalidArgument(f"{name} is not served by the vLLM worker")
        if not request.multimodal.batches:
            return {"type": "token", "prompt_token_ids": prompt}, params, None
        inputs = open_request(self.consumer, request.multimodal, verify=self.verify, prompt_len=len(prompt),
                              limits=self.limits)
        try:
            built = engine_prompt(prompt, inputs, handles_to_model=self.handles_to_model)
            if self.inject_into_shm_cache:
                # vLLM's own shared-memory cache, fed as Dynamo feeds it: each item is copied into
                # its ring and replaced by the ring's address (the peer our handles are measured
                # against).
                self.engine.input_processor.inject_into_mm_cache(built["mm_hashes"], built["mm_kwargs"])
        except BaseException:
            inputs.consumed()
            raise
        if self.handles_to_model:
            return built, params, inputs
        inputs.consumed()  # deferred by the client until vLLM drops its last view of the bytes
        return built, params, None

    async def _outputs(self, request: gpb.GenerateRequest) -> AsyncIterator[tuple[Any, int]]:
        loop = asyncio.get_running_loop()
        prompt, params, held = await loop.run_in_executor(None, self._prepare, request)
        request_id = request.request_id or f"shmt-{id(request):x}"
        finished = False
        try:
            async for out in self.engine.generate(prompt=prompt, sampling_params=params, request_id=request_id):
                finished = finished or out.finished
                yield out, len(prompt["prompt_token_ids"])
        finally:
            if held is not None:
                if finished:
                    held.consumed()
                else:
                    loop.call_later(ABORT_GRACE_S, held.consumed)

    async def GenerateStream(self, request: gpb.GenerateRequest,
                             context: _StreamContext) -> AsyncIterator[gpb.GenerateStreamChunk]:
        """Generate through vLLM's engine, one chunk per step; a cancelled call aborts the request."""
        first = True
        total = 0
        try:
            async for out, n_prompt in self._outputs(request):
                completion = out.outputs[0]
                chunk = _chunk(completion, params_logprobs=request.sampling.HasField("logprobs"))
                total += len(completion.token_ids)
                if first:
                    chunk.num_prompt_tokens = n_prompt
                    first = False
                if completion.finish_reason:
                    chunk.terminal = True
                    chunk.finish_reason = _FINISH.get(completion.finish_reason, gpb.FINISH_REASON_STOP)
                    chunk.num_output_tokens = total
                    stop = completion.stop_reason
                    if isinstance(stop, int):
                        chunk.matched_stop.stop_token_id = stop
                    elif isinstance(stop, str):
                        chunk.matched_stop.stop_string = stop
                yield chunk
        except ShmTransportError:  # some are ValueErrors: not the engine's
            raise
        except _request_errors() as exc:  # vLLM's own validation of the request
            raise InvalidArgument(f"engine rejected the request: {exc}") from exc

    async def Generate(self, request: gpb.GenerateRequest, context: _UnaryContext) -> gpb.GenerateResponse:
        """``GenerateStream``'s chunks folded into one response."""
        from ..protocol.folding import fold

        chunks = [c async for c in self.GenerateStream(request, context)]
        return fold(chunks, request_id=request.request_id)


def _processor_cache_type(engine: Any) -> str | None:
    """vLLM's ``--mm-processor-cache-type`` of ``engine`` when its multimodal processor cache is on."""
    config = getattr(engine, "vllm_config", None)
    multimodal = config.model_config.multimodal_config if config is not None else None
    if multimodal is None or multimodal.mm_processor_cache_gb <= 0:
        return None
    return str(multimodal.mm_processor_cache_type)


def _request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request: ValueError / TypeError, and since 0.32 its own
    ``VLLMClientError`` (e.g. a token id outside the vocabulary), which is neither."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError, TypeError)
    return (ValueError, TypeError, VLLMClientError)


def _chunk(completion: Any, *, params_logprobs: bool) -> gpb.GenerateStreamChunk:
    ids = list(completion.token_ids)
    chunk = gpb.GenerateStreamChunk(index=0, num_tokens=len(ids), token_ids=ids)
    if params_logprobs and completion.logprobs:
        for tok, entry in zip(ids, completion.logprobs):
            chunk.logprobs.append(entry[tok].logprob)
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)
            chunk.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp.logprob for _, lp in top])
    return chunk


def install_handle_resolver(config: Any, daemon_socket: str) -> None:
    """Make the engine's worker class ``model_worker.HandleResolvingWorker``, extending the class
    the platform (or the user's ``--worker-cls``) chose; its processes inherit, through the
    environment, which class that is and where the daemon listens."""
    parallel = config.parallel_config
    if parallel.worker_cls != model_worker.WORKER_CLS:
        os.environ[model_worker.BASE_WORKER_ENV] = parallel.worker_cls
    os.environ[model_worker.DAEMON_SOCKET_ENV] = daemon_socket
    parallel.worker_cls = model_worker.WORKER_CLS


async def serve(args: argparse.Namespace) -> None:
    """Load the engine and serve the generator over gRPC on ``args.address`` until SIGTERM or SIGINT."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from ..protocol.spec import grpc_options

    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    handles_to_model = args.model_inputs == "handles"
    if handles_to_model:
        install_handle_resolver(config, args.daemon_socket)
    engine = AsyncLLM.from_vllm_config(vllm_config=config, usage_context=UsageContext.OPENAI_API_SERVER,
                                       disable_log_stats=True)
    consumer = Consumer(args.daemon_socket)
    server = grpc.aio.server(options=grpc_options(64 << 20), interceptors=[AioErrorBoundary()])
    gpb_grpc.add_GeneratorServicer_to_server(VllmGeneratorService(engine, consumer, verify=args.verify,
                                                                  handles_to_model=handles_to_model), server)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(args.address) == 0:
        raise SystemExit(f"vllm-worker: cannot listen on {args.address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"shmtransport vllm-worker serving on {args.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        engine.shutdown()
        consumer.close()


PROG = "shmtransport vllm-worker"


class _OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line is one line on stderr and exit status 2: vLLM's usage alone
    is ~250 lines, which would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_our_flags(parser: argparse.ArgumentParser) -> None:
    from ..wire import default_socket_path

    parser.add_argument("--address", default="127.0.0.1:50061", help="gRPC address (HOST:PORT or unix:PATH)")
    parser.add_argument("--daemon-socket", default=default_socket_path(), help="shmtransportd socket")
    parser.add_argument("--verify", choices=("always", "never"), default="always",
                        help="recompute each item's identity from shared memory before the engine runs")
    parser.add_argument("--model-inputs", choices=("handles", "views"), default="handles",
                        help="handles: tensors reach the process where the model runs as handles and are "
                             "mapped there (our worker class); views: vLLM's API process gets views and "
                             "vLLM copies the bytes to the model itself")


def build_parser() -> argparse.ArgumentParser:
    """vLLM's own parser (every engine flag) with ours added. Sets ``environment.PRIVACY_DEFAULTS``
    where unset and imports vLLM: raises ModuleNotFoundError without it (``shmtransport
    vllm-worker`` says what to install)."""
    environment.apply_defaults(environment.PRIVACY_DEFAULTS)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(_OneLineErrors, FlexibleArgumentParser):  # type: ignore[misc]  # vLLM has no type hints
        pass

    parser = Parser(prog=PROG, description=DESCRIPTION)
    _add_our_flags(parser)
    return cast(argparse.ArgumentParser, AsyncEngineArgs.add_cli_args(parser))


def _early_args(argv: list[str]) -> argparse.Namespace | None:
    """Our flags and ``--model`` as vLLM's parser will read them, read without importing vLLM
    (5-25 s) so that the checks before the engine loads answer at once; None where only vLLM's
    parser can read them (``--help``, a ``--config`` file)."""
    if any(arg in ("-h", "--help", "--config") or arg.startswith(("--help=", "--config=")) for arg in argv):
        return None
    parser = _OneLineErrors(prog=PROG, add_help=False)  # abbreviations resolve as in vLLM's parser
    _add_our_flags(parser)
    parser.add_argument("--model")
    return parser.parse_known_args([_dashed(arg) for arg in argv])[0]


def _dashed(arg: str) -> str:
    """A flag as vLLM's parser reads it: ``--daemon_socket=x`` is ``--daemon-socket=x``."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _address_problem(address: str) -> str | None:
    """Why the gRPC server could not listen on ``address``, found before the engine loads; None
    when it can (or for address schemes other than ``unix:`` and ``HOST:PORT``, left to gRPC)."""
    path = unix_socket_path(address)
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        return None if os.path.isdir(parent) else f"cannot listen on {address}: no directory {parent}"
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not host:
        return None if "://" in address else f"--address {address!r} is neither HOST:PORT nor unix:PATH"
    if not port.isdigit() or int(port) > 65535:
        return f"--address {address!r}: the port must be a number from 0 to 65535"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            probe.bind(infos[0][4])
    except OSError as exc:
        return f"cannot listen on {address}: {exc.strerror or exc}"
    return None


def _model_problem(model: str | None) -> str | None:
    """A model given as a local path (absolute, ``./``, ``../``, ``~``) that does not exist; a hub
    id is vLLM's to resolve."""
    if not model or not model.startswith(("/", "./", "../", "~")):
        return None
    path = os.path.expanduser(model)
    return None if os.path.exists(path) else f"--model {model}: no such file or directory"


def _vllm_problem(model_inputs: str, processor_cache_type: str | None = None) -> str | None:
    """Why handles cannot ride to the model through the installed vLLM, or with vLLM's own
    shared-memory cache; None when they can (or are not asked for)."""
    if model_inputs != "handles":
        return None
    if processor_cache_type == "shm":
        return "--mm-processor-cache-type shm is vLLM's own way to the model: it takes --model-inputs views"
    import vllm

    problem = model_worker.check_vllm_version(vllm.__version__)
    return None if problem is None else f"{problem} (--model-inputs views works with it)"


def _daemon_problem(daemon_socket: str) -> str | None:
    """Why this process cannot be a client of the daemon at ``daemon_socket``; None when it can."""
    try:
        Consumer(daemon_socket, timeout_s=5.0).close()
    except (ShmTransportError, OSError) as exc:
        return f"no usable shmtransport daemon at {daemon_socket}: {exc}"
    return None


def _problem(args: argparse.Namespace, claims: contextlib.ExitStack) -> str | None:
    """What is wrong with the address, the model path or the daemon (none of it needs vLLM). A
    ``unix:PATH`` address is claimed into ``claims`` (``socket_lock.claim_socket``): while another
    live worker serves that path this raises ``SocketInUse`` and leaves its socket alone."""
    problem = _address_problem(args.address) or _model_problem(args.model)
    path = unix_socket_path(args.address)
    if path is not None and problem is None:
        claims.enter_context(claim_socket(path, PROG))
    return problem or _daemon_problem(args.daemon_socket)


def main(argv: list[str], parser: Callable[[], argparse.ArgumentParser] = build_parser) -> int:
    """``shmtransport vllm-worker``: parse vLLM's flags and ours (``parser``: vLLM's, which imports
    it), then serve until SIGTERM or SIGINT; the exit status. What can be checked before the engine
    loads (it takes minutes on a real model) is checked first, each problem one line and exit status
    2: the address, the model path and the daemon before vLLM is imported (unless only its parser
    can read the flags), then the installed vLLM. A claimed ``unix:PATH`` address is unlinked at exit
    while still ours."""
    early = _early_args(argv)
    with contextlib.ExitStack() as claims:
        problem = None if early is None else _problem(early, claims)
        if problem is None:
            args = parser().parse_args(argv)
            problem = ((_problem(args, claims) if early is None else None)
                       or _vllm_problem(args.model_inputs, args.mm_processor_cache_type))
        if problem is not None:
            print(f"{PROG}: {problem}", file=sys.stderr)
            return 2
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        import uvloop

        uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
