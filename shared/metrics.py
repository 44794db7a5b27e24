"""Every Prometheus metric name, in one place: the API, the workers, the dashboard and the alert
rules all spell them from here (the dashboard JSON and the rules are checked against this list).

Conventions: the `storyteller_` prefix, base units (seconds, tokens, ratios 0-1), `_total` for
counters, and label values from bounded sets (a model name, a route, a status code, an error code,
a priority -10..10), never a request id or an API key.
"""

PREFIX = "storyteller"

# Read from Redis at scrape time by the API (labels: model, and priority for the queue).
QUEUE_DEPTH = f"{PREFIX}_queue_depth"                  # jobs waiting, per model and priority
OLDEST_JOB_AGE = f"{PREFIX}_oldest_job_age_seconds"    # per model: how long the head job has waited
WORKERS_ALIVE = f"{PREFIX}_workers_alive"              # per model: workers with a live heartbeat
# Per model: worker processes started (restarts show here). Counted in Redis, not by the worker:
# a restarted worker's own counter would start from scratch, and a restart would not show.
WORKER_STARTS = f"{PREFIX}_worker_starts_total"

# The API (labels: route, status, model, code).
REQUESTS = f"{PREFIX}_requests_total"                  # by route and HTTP status
REQUEST_LATENCY = f"{PREFIX}_request_duration_seconds"  # by route: whole request, to its last byte
TIME_TO_FIRST_TOKEN = f"{PREFIX}_time_to_first_token_seconds"  # by model: request in -> first text
PROMPT_TOKENS = f"{PREFIX}_prompt_tokens_total"        # by model, as answered in `usage`
COMPLETION_TOKENS = f"{PREFIX}_completion_tokens_total"  # by model, as answered in `usage`
ERRORS = f"{PREFIX}_errors_total"                      # by error code (queue_full, timeout, ...)

# The workers (label: model).
QUEUE_WAIT = f"{PREFIX}_queue_wait_seconds"            # a job's time in the queue before a worker took it
TIME_PER_OUTPUT_TOKEN = f"{PREFIX}_time_per_output_token_seconds"  # a job's decode time / its tokens
BATCH_SIZE = f"{PREFIX}_batch_size"                    # sequences computed per engine step
RUNNING = f"{PREFIX}_running_sequences"
WAITING = f"{PREFIX}_waiting_sequences"                # taken by the worker, not yet scheduled
KV_CACHE_USAGE = f"{PREFIX}_kv_cache_usage_ratio"      # blocks in use / blocks in the pool
PREEMPTIONS = f"{PREFIX}_preemptions_total"
PREFIX_CACHE_HITS = f"{PREFIX}_prefix_cache_hits_total"  # prompt blocks found in the cache
GENERATED_TOKENS = f"{PREFIX}_generated_tokens_total"  # tokens the engine wrote (tokens/s)
PREFIX_CACHE_HIT_TOKENS = f"{PREFIX}_prefix_cache_hit_tokens_total"  # prompt tokens found in the cache
# Jobs the API offered to the worker holding their conversation (shared/routing.py), taken by that
# worker ("own") or, once the offer lapsed, by another ("other"); and the requests the API routed.
OFFERED_JOBS = f"{PREFIX}_offered_jobs_total"
OFFER_WAIT = f"{PREFIX}_offer_wait_seconds"  # an offered job's time in the queue before a worker took it
ROUTED_REQUESTS = f"{PREFIX}_routed_requests_total"
FORCED_TOKENS = f"{PREFIX}_forced_tokens_total"  # of those, tokens a grammar forced (no step of their own)
REQUEUED_JOBS = f"{PREFIX}_requeued_jobs_total"        # jobs of dead workers put back
# Tokens a requeued job's new worker took from its record (keys.written) instead of decoding again.
RESUMED_TOKENS = f"{PREFIX}_resumed_tokens_total"
CRASHED_JOBS = f"{PREFIX}_crashed_jobs_total"          # jobs failed after --max-attempts
# Requeued jobs a worker passed over for a moment, for a live worker of their dead worker's numerics
# fingerprint (worker/job_queue.PREFER_SAME_NUMERICS_S): each once per worker.
LEFT_FOR_SAME_NUMERICS = f"{PREFIX}_jobs_left_for_same_numerics_total"
