"""python -m worker: load the model once, then serve its queue until SIGTERM."""
from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
import uuid

import redis
import torch

from shared.protocol import FEATURE_GRAMMAR, WorkerInfo
from shared.redis_client import connect, explain, masked
from shared.settings import Settings
from worker import clock, memory, metrics, model_loader
from worker.continuous import engine as continuous
from worker.continuous.kernels import ISAS
from worker.continuous.linear import check_small_kernel_name
from worker.continuous.scheduler import POLICIES
from worker.faults import Faults
from worker.job_queue import JobQueue, late_beat_s
from worker.static_engine import StaticEngine
from worker.worker import Worker

FLAGS = ["redis_url", "redis_cluster", "model", "model_name", "engine", "batch", "wait_ms", "dtype", "device",
         "block_size", "kv_blocks", "kv_memory", "kv_dtype", "max_batch_tokens", "prefill_chunk", "step_fill", "max_stretch",
         "scheduler", "prefix_caching", "jump_forward", "int4_rows", "small_kernel", "huge_pages", "kernel_isa", "int4_head", "torch_threads", "cache_dir",
         "max_attempts", "metrics_port", "metrics_host"]
STATIC_DEFAULT_BATCH = 64
# A cut link stalls TCP without an error (no RST): each Redis call gives up after this, so a worker
# behind one logs it, goes on trying, and reconnects once the link is back, instead of waiting on a
# reply that may never come (for ~15 minutes until TCP gives up, or for ever once Redis has dropped
# its side). Well above the longest call it makes (an idle worker's 0.5 s BLPOP). redis-py 8 has
# the same defaults, but its versions before 6 had none: said here, they can't silently go.
REDIS_TIMEOUT_S = 5.0


def check(settings: Settings) -> None:
    if settings.engine not in ("continuous", "static"):
        raise SystemExit(f"--engine {settings.engine!r}: expected continuous or static")
    if settings.scheduler not in POLICIES:
        raise SystemExit(f"--scheduler {settings.scheduler!r}: expected one of {', '.join(POLICIES)}")
    try:
        check_small_kernel_name(settings.small_kernel)
    except ValueError as exc:
        raise SystemExit(str(exc))
    if settings.kv_dtype not in continuous.KV_DTYPES:
        raise SystemExit(f"--kv-dtype {settings.kv_dtype!r}: expected one of {', '.join(continuous.KV_DTYPES)}")
    if settings.kernel_isa not in ISAS:
        raise SystemExit(f"--kernel-isa {settings.kernel_isa!r}: expected one of {', '.join(ISAS)}")
    if settings.int4_rows < -1:
        raise SystemExit("--int4-rows must be -1 (every step), 0 (never) or a number of tokens")
    for name in ("batch", "kv_blocks", "torch_threads", "step_fill"):
        if getattr(settings, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be 0 or more")
    if settings.max_stretch and settings.max_stretch < 1:
        raise SystemExit("--max-stretch must be 0 (untimed) or at least 1")
    for name in ("block_size", "kv_memory", "max_batch_tokens", "prefill_chunk"):
        if getattr(settings, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    # A worker takes the jobs of one name, the queue of the one model it loads: a list here would be
    # one odd name that no client asks for, and its worker would sit idle.
    if "," in settings.model_name:
        raise SystemExit(f"--model-name {settings.model_name!r}: a worker serves one model name, the "
                         f"model it loads; for more names or models, start a worker for each")


def make_engine(settings: Settings, loaded: model_loader.LoadedModel):
    """The engine asked for; the static one when the continuous one has no code for the model."""
    if settings.engine == "continuous":
        try:
            engine = continuous.build(loaded, settings, loaded.weights(), loaded.config)
        except ValueError as exc:  # a setting this machine cannot honour (--small-kernel)
            raise SystemExit(f"worker: {exc}")
        if engine is not None:
            # The engine holds what it needs, repacked: transformers' copy and the tensors can go,
            # and with them the file's mapping and the unpacking's temporaries.
            loaded.model = loaded.tensors = None
            memory.release_after_load()
            return engine, loaded
        if loaded.model is None:  # read as tensors only: the static engine needs transformers' model
            loaded = model_loader.load(settings.model, settings.model_name, settings.dtype,
                                       settings.device, cache_dir=settings.cache_dir)
    return StaticEngine(loaded, capacity=settings.batch or STATIC_DEFAULT_BATCH), loaded


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    settings = Settings.parse(argv, FLAGS, "Storyteller model worker")
    check(settings)
    faults = Faults.from_env()
    if faults:
        logging.warning("test faults on (%s): this worker is for a test, not for serving", faults.describe())
    started = time.monotonic()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        # (A cluster's client reads the cluster's layout as it is made: that fails here too.)
        client = connect(settings.redis_url, socket_connect_timeout=5, socket_timeout=REDIS_TIMEOUT_S,
                         socket_keepalive=True)
        client.ping()  # fail now, with a clear error, rather than after loading the model
    except redis.RedisError as exc:
        raise SystemExit(f"worker: cannot use Redis at {masked(settings.redis_url)}: {explain(exc)}")

    loaded = model_loader.load(settings.model, settings.model_name, settings.dtype, settings.device,
                               transformers_model=settings.engine == "static", cache_dir=settings.cache_dir)
    engine, loaded = make_engine(settings, loaded)
    # What loading made lives as long as the worker: out of the collector's sight, so its passes
    # over the young objects a step makes stay short (measured: docs/serving.md, "Measurements
    # behind the engine's choices").
    gc.collect()
    gc.freeze()
    files = model_loader.tokenizer_files(loaded.tokenizer)
    worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    queue = JobQueue(client, worker_id, loaded.name, settings.answer_ttl_s, settings.max_attempts, engine.numerics,
                     late_beat_s(settings.heartbeat_s, settings.heartbeat_ttl_s))
    queue.store_tokenizer(files)
    info = WorkerInfo(
        id=worker_id, model=loaded.name, context_window=loaded.context_window, engine=engine.name,
        batch=engine.capacity, device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
        tokenizer_digest=model_loader.digest(files),
        pid=os.getpid(), host=socket.gethostname(), started=clock.wall(faults.clock_skew_s), numerics=engine.numerics,
        features=list(engine.features))
    grammars = None
    if FEATURE_GRAMMAR in engine.features:
        from worker.constraint import Grammars  # llguidance
        grammars = Grammars(loaded.tokenizer, loaded.vocab_size, queue.grammar)
        threading.Thread(target=grammars.warm, name="grammars-warm", daemon=True).start()
    worker = Worker(queue, engine, info, settings, grammars, faults)
    worker.install_signal_handlers()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, metrics.EngineCollector(info.model, engine, queue.requeued,
                                                                     queue.crashed, queue.left_for_numerics,
                                                                     queue.offers),
                      settings.metrics_host)
    logging.info("serving %s (%s, %s, context %d) on the %s engine, up to %d requests at once; "
                 "ready %.1f s after start", info.model, info.device, info.dtype, info.context_window,
                 engine.name, engine.capacity, time.monotonic() - started)
    worker.run()


if __name__ == "__main__":
    main()
