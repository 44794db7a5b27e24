"""Same request, same text: a row's numbers depend only on its own tokens and position.

On the packaged SmolLM2 with the default settings (its GGUF blocks, the default dtype and kernels),
not only on tiny random models, whose path differs: the kernel's bits for one row at every step
size and place in the step, a prompt's cache blocks however it was chunked, and a crowd of
requests arriving at random steps, with shared prefixes, preemption, greedy and seeded, streamed
and not, each writing 32-40 tokens and exactly what it writes alone (and the control: the same
check finds requests that differ under --int4-rows 16, a setting that is not invariant). And the
same on the packaged file requantized by llama.cpp's quantizer to what users download (Q4_K_M,
Q5_K_M, Q8_0, Q4_0: the K-quant, Q5_0 and Q5_1 tensors on csrc/kquants.h, Q4_0 read as Q4_1 and
Q8_0 on the VNNI panels): each says "+invariant" and its crowd, with preemption, writes what each
request writes alone; and on the Q4_K_M file again with the kernels built for AVX2 alone
(--kernel-isa avx2), as a worker on a CPU without AVX-512 runs it (on such a CPU that is the native
build, so the crowd runs once).
"""
from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from tests.engines import run_until_idle, write, write_arriving
from worker.continuous import engine as continuous
from worker.continuous import kernels
from tests.gguf_files import SMOLLM2_TYPES
from worker.continuous.linear import EVERY_STEP, INVARIANT, Linear
from worker.continuous.weights import Q41, Q80
from worker.model_loader import PACKAGED, load

pytestmark = pytest.mark.slow

WORDS = ("the dragon castle knight went over a hill and found gold under an old tree by the river "
         "where the bard sang of night storms ships orcs and a lost crown").split()


@pytest.fixture(scope="module")
def smollm2():
    return load(PACKAGED, dtype="auto", device="cpu", transformers_model=False,  # the worker's defaults
                cache_dir=Settings().cache_dir)


def _engine(loaded, **settings):
    return continuous.build(loaded, Settings(**settings), loaded.weights(), loaded.config)


def _alone(loaded, **settings):
    """What each request writes alone: an engine of its own, idle between requests, no prefix cache."""
    engine = _engine(loaded, prefix_caching=False, **settings)
    cache = {}

    def write(job: Job):
        key = (tuple(job.prompt_ids), job.params.max_tokens, job.params.temperature, job.params.seed)
        if key not in cache:
            seq = engine.add(job)
            run_until_idle(engine)
            cache[key] = (seq.output_ids, seq.text)
        return cache[key]
    return write


@pytest.fixture(scope="module")
def alone(smollm2):
    return _alone(smollm2)


@pytest.fixture(scope="module", params=[(t, "native") for t in SMOLLM2_TYPES]
                + [("Q4_K_M", isa) for isa in kernels.distinct_isas() if isa != "native"],
                ids=lambda p: p[0] if p[1] == "native" else "-".join(p))
def requantized(request, smollm2_gguf):
    """(the packaged SmolLM2 requantized to the param's type by llama-quantize, loaded as the worker
    loads it; what each request writes alone on it; the settings: the param's --kernel-isa)."""
    qtype, isa = request.param
    loaded = load(smollm2_gguf(qtype), dtype="auto", device="cpu", transformers_model=False,
                  cache_dir=Settings().cache_dir)
    return loaded, _alone(loaded, kernel_isa=isa), {"kernel_isa": isa}


def _integer_kernel_here() -> str:
    """The integer kernel this CPU's instruction sets call for (the headers' conditions,
    csrc/panels.h and csrc/int8.h): the VNNI panels with AVX-512 F, BW and VNNI, the fastest at
    every row count there; else the AVX2 one with AVX2, FMA and F16C."""
    flags = set(kernels.cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "int8-vnni-panels"
    if {"avx2", "fma", "f16c"} <= flags:
        return "int8-avx2"
    pytest.skip("no integer kernel for this CPU (neither AVX-512 VNNI nor AVX2): the default worker is not "
                "batch-invariant here")


def test_the_default_worker_is_batch_invariant_and_says_so(smollm2):
    expected = _integer_kernel_here()
    engine = _engine(smollm2)
    assert expected in engine.runner.kernel.PATHS, (expected, engine.runner.kernel.PATHS)  # built for this CPU
    assert engine.numerics.endswith("+invariant"), engine.numerics
    # Its Q4_1 and Q8_0 blocks on the integer kernel this CPU calls for, at every step, none dense.
    linears = engine.runner.model.linears()
    assert {layer.path for layer in linears} == {expected}, {layer.path for layer in linears}
    assert all(layer.weight is None for layer in linears)
    assert expected in engine.numerics, engine.numerics


def test_a_requantized_file_is_batch_invariant_and_says_so(requantized):
    """Every product on a kernel with the same bits at every step size, and the fingerprint names
    the paths: the integer kernels for Q8_0 tensors, the dense panels for the ones made dense."""
    loaded, _, settings = requantized
    engine = _engine(loaded, **settings)
    assert engine.numerics.endswith("+invariant"), engine.numerics
    linears = engine.runner.model.linears()
    paths = set().union(*(layer.paths for layer in linears))
    assert all(layer.invariant and layer.weight is None for layer in linears), paths
    assert all(path in engine.numerics for path in paths), (paths, engine.numerics)
    # Every matrix on an integer kernel, none made dense: the K-quant kernel for K-quant files'
    # Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 tensors, the Q4_1/Q8_0 one for Q8_0 and Q4_0 (as the Q4_1 it is).
    integer = "int8-avx2" if settings["kernel_isa"] == "avx2" else _integer_kernel_here()
    kquants = "int8-avx2-kquants" if integer == "int8-avx2" else "int8-vnni-kquants"
    if loaded.name.endswith("_K_M"):
        assert kquants in paths and paths <= {kquants, integer}, paths
    else:
        assert paths == {integer}, paths


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_one_rows_product_has_the_same_bits_at_every_step_size_and_place(smollm2, kind):
    """The integer kernel, as the model holds it (and the head, Q8_0), at 1-512 rows."""
    kernel = _engine(smollm2).runner.kernel
    g = torch.Generator().manual_seed(1)
    rows, cols = (960, 576) if kind == "q4_1" else (64, 576)
    if kind == "q4_1":
        w = Q41(q=torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g),
                d=torch.rand(rows, cols // 32, generator=g).half().float() / 50,
                m=-torch.rand(rows, cols // 32, generator=g).half().float() / 10)
    else:
        w = Q80(q=torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g),
                d=torch.rand(rows, cols // 32, generator=g).half().float() / 50)
    layer = Linear(w, None, smollm2.dtype, torch.device("cpu"), EVERY_STEP, kernel)
    x = torch.randn(512, cols, generator=g).to(smollm2.dtype)
    each = torch.cat([layer(x[i:i + 1]) for i in range(512)])  # every row alone
    for size in list(range(1, 66)) + [100, 127, 128, 129, 255, 256, 300, 511, 512]:
        for start in (0, 512 - size, (512 - size) // 2):  # the same rows at other places in the step
            step = layer(x[start:start + size])
            assert torch.equal(step, each[start:start + size]), (size, start)


def _prompt(rng: random.Random, loaded, shared: list[str], words: int) -> list[int]:
    text = rng.choice(shared) + " " + " ".join(rng.choice(WORDS) for _ in range(words))
    return loaded.tokenizer(text).input_ids


def test_a_prompt_leaves_the_same_cache_blocks_however_it_was_chunked(smollm2):
    ids = _prompt(random.Random(2), smollm2, ["Once upon a time"], 140)[:150]
    # Two tokens: the prefill's last step writes one, and the request still holds its blocks after it.
    job = Job(id="p", model="m", prompt_ids=ids, params=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
              timeout_s=60)
    blocks = {}
    for chunk in (512, 64, 16, 7, 1):
        engine = _engine(smollm2, max_batch_tokens=chunk, prefill_chunk=chunk, step_fill=chunk,
                         prefix_caching=False, max_stretch=0)
        engine.add(job)
        [req] = engine.scheduler.requests()
        while req.computed < len(ids):
            engine.step()
        table, cache = req.table.blocks, engine.runner.cache
        blocks[chunk] = (torch.cat([cache.k[:, :, table], cache.v[:, :, table]])
                         .flatten(2, 3)[:, :, :len(ids)].clone())
    for chunk in (64, 16, 7, 1):
        assert torch.equal(blocks[chunk], blocks[512]), chunk


TOKENS = (32, 40)  # each crowd request writes this many, end of text ignored: long enough to diverge


def _crowd(loaded, count: int, seed: int, spread: int = 60) -> list[tuple[int, Job]]:
    """(arrival step, job): random prompt lengths (sharing prefixes), max_tokens (TOKENS) and
    arrivals (over `spread` steps); every other one seeded with top-p, a third streamed."""
    rng = random.Random(seed)
    shared = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 100))) for _ in range(5)]
    jobs = []
    for i in range(count):
        seeded = i % 2 == 1
        params = SamplingParams(max_tokens=rng.randint(*TOKENS), temperature=0.8 if seeded else 0.0,
                                top_p=0.95 if i % 4 == 1 else 1.0, seed=1000 + i if seeded else None,
                                ignore_eos=True)
        jobs.append((rng.randint(0, spread), Job(id=f"r{i}", model="m", prompt_ids=_prompt(rng, loaded, shared, rng.randint(1, 60)),
                                           params=params, timeout_s=300, stream=i % 3 == 0)))
    return jobs


def _differ_from_alone(engine, jobs, alone) -> list[str]:
    """The crowd written on `engine` (each job added at its arrival step): the ids of the jobs that
    wrote other tokens or text than `alone` gives."""
    seqs = write_arriving(engine, jobs)
    return [job.id for _, job in jobs if (seqs[job.id].output_ids, seqs[job.id].text) != alone(job)]


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_a_crowd_writes_what_each_request_writes_alone(smollm2, alone, pool):
    """24 requests of 32-40 tokens, greedy and seeded, streamed and not, arriving at random steps
    with shared prefixes (prefix caching on); once with a pool small enough to force preemption.
    The same crowd both times (what each writes alone is computed once)."""
    jobs = _crowd(smollm2, 24, seed=3)
    longest = max(len(job.prompt_ids) + job.params.max_tokens for _, job in jobs)
    assert longest <= 14 * 16, longest
    # 14 blocks of 16 tokens hold the longest request (~200 tokens) but not the crowd: running requests
    # that need a block when none is free preempt the newest (untimed steps: the same schedule each run).
    engine = _engine(smollm2, kv_blocks=14, max_stretch=0) if pool == "preempting" else _engine(smollm2)
    differ = _differ_from_alone(engine, jobs, alone)
    stats = engine.stats()
    assert stats["prefix_hit_blocks"] > 0
    if pool == "preempting":
        assert stats["preempted"] > 0
    assert not differ, f"{len(differ)} of {len(jobs)} wrote other text than alone: {differ}"


def test_the_crowd_check_finds_the_difference_a_setting_that_is_not_invariant_makes(smollm2):
    """The negative control of the crowd check: --int4-rows 16 runs the integer kernel on steps of up
    to 16 rows and the dense product (torch's, whose sums change with the number of rows) beyond,
    so a crowd's decode steps of more than 16 rows are not what each writes alone. The fingerprint
    says so, and the same check, against each request alone on the same setting, finds them: the
    check can fail. 24 requests arriving in 10 steps, so that most decode steps hold more than 16."""
    engine = _engine(smollm2, int4_rows=16, max_stretch=0)
    assert not engine.numerics.endswith("+invariant") and "-to-16-rows+dense" in engine.numerics, engine.numerics
    jobs = _crowd(smollm2, 24, seed=9, spread=10)
    differ = _differ_from_alone(engine, jobs, _alone(smollm2, int4_rows=16))
    assert differ, "--int4-rows 16: every request of the crowd wrote what it writes alone"


def test_a_requantized_files_crowd_writes_what_each_request_writes_alone(requantized):
    """On each file, a crowd arriving close together, greedy and seeded, streamed and not, with
    shared prefixes and a pool small enough to force preemption: each writes what it writes alone.
    Smaller than the packaged file's crowds (12 requests arriving in 6 steps, not 24 in 60), to keep
    the time of five files. Each writes 32-40 tokens, past the one block
    of margin it is admitted with, so the running ones outgrow the pool and the newest is preempted."""
    loaded, alone, settings = requantized
    jobs = [(step // 12, Job(id=job.id, model=job.model, prompt_ids=job.prompt_ids, timeout_s=job.timeout_s,
                             stream=job.stream, params=SamplingParams(**{**vars(job.params), "max_tokens": TOKENS[0] + i % 3 * 4})))
            for i, (step, job) in enumerate(_crowd(loaded, 12, seed=8))]
    engine = _engine(loaded, kv_blocks=14, max_stretch=0, **settings)  # 224 tokens: the longest request, not the crowd
    differ = _differ_from_alone(engine, jobs, alone)
    stats = engine.stats()
    assert stats["prefix_hit_blocks"] > 0 and stats["preempted"] > 0, stats
    assert not differ, f"{loaded.name}: {len(differ)} of {len(jobs)} wrote other text than alone: {differ}"


def test_an_engine_built_again_writes_the_same_texts(smollm2, alone):
    """A worker started again (or another of the pool, same fingerprint) computes the same bits.
    (The crowd tests' requests: what each writes alone is known already.)"""
    jobs = _crowd(smollm2, 24, seed=3)
    seqs = write_arriving(_engine(smollm2), jobs)
    assert [seqs[job.id].output_ids for _, job in jobs] == [alone(job)[0] for _, job in jobs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_model_with_dense_weights_is_batch_invariant_too(smollm2_dense, dtype):
    """SmolLM2 as a local Hugging Face directory would give it (transformers' dense weights): the
    dense products run csrc/dense_panels.h at every step; a crowd writes what each writes alone."""
    loaded = smollm2_dense
    if dtype == "bfloat16":  # transformers' loader casts the float32 it dequantizes, so its bfloat16 load
        # is this cast bit for bit (compared tensor by tensor, 2026-12-07), without a second ~17 s load
        loaded = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).to(torch.bfloat16), dtype=torch.bfloat16)
    engine = continuous.build(loaded, Settings(), loaded.model.state_dict(), loaded.config)
    if not engine.numerics.endswith("+invariant"):
        pytest.skip(f"no row-wise dense kernel for {dtype} on this CPU ({engine.numerics})")
    assert {layer.path for layer in engine.runner.model.linears()} == {"dense-panels"}
    jobs = _crowd(loaded, 10, seed=6)  # 10, fewer than the others: the dense panels are slower than the integer kernels
    seqs = write_arriving(engine, jobs)
    single = continuous.build(loaded, Settings(prefix_caching=False), loaded.model.state_dict(), loaded.config)
    for _, job in jobs:
        [seq] = write(single, [job])
        assert seq.output_ids == seqs[job.id].output_ids, job.id


def test_penalties_and_grammars_keep_the_crowd_equal_to_alone(smollm2):
    """With penalties, biases, min_p and grammar masks on, each row still writes what it writes alone:
    they change its own logits only (worker/logits.py), and the mask is the row's own matcher's."""
    import hashlib
    import json

    import llguidance

    from worker.constraint import Grammars

    schema = {"type": "object", "properties": {"mood": {"enum": ["grumpy", "happy"]},
                                               "gold": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "line": {"type": "string", "maxLength": 30}},
              "required": ["mood", "gold", "line"], "additionalProperties": False}
    texts = [llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False}),
             llguidance.LLMatcher.grammar_from_regex("(yes|no|maybe), because [a-z ]{1,20}\\.")]
    store = {hashlib.sha256(t.encode()).hexdigest(): t for t in texts}
    grammars = Grammars(smollm2.tokenizer, smollm2.vocab_size, store.get)
    digests = list(store)
    extras = [dict(presence_penalty=0.8, frequency_penalty=0.4), dict(repetition_penalty=1.3),
              dict(logit_bias={"29": 5.0, "30": -100.0}), dict(min_p=0.1), dict(grammar=digests[0]),
              dict(grammar=digests[1], frequency_penalty=0.5), dict(min_tokens=6, stop_token_ids=[30]), dict()]
    jobs = [(step, Job(id=job.id, model="m", prompt_ids=job.prompt_ids, timeout_s=300, stream=job.stream,
                       params=SamplingParams(**{**vars(job.params), "max_tokens": 40 if i % 8 in (4, 5) else TOKENS[0],
                                                "ignore_eos": i % 8 not in (4, 5), **extras[i % 8]})))
            for i, (step, job) in enumerate(_crowd(smollm2, 24, seed=6))]

    def add(engine, job, written=None):
        constraint = grammars.constraint(job.params.grammar) if job.params.grammar else None
        return engine.add(job, written, constraint)

    seqs = write_arriving(_engine(smollm2), jobs, add)
    lone = _engine(smollm2, prefix_caching=False)
    differ = []
    for _, job in jobs:
        seq = add(lone, job)
        run_until_idle(lone)
        if (seq.output_ids, seq.text) != (seqs[job.id].output_ids, seqs[job.id].text):
            differ.append(job.id)
        if job.params.grammar == digests[0] and seq.finish_reason == "stop":
            assert set(json.loads(seq.text)) == {"mood", "gold", "line"}
    assert not differ, f"{len(differ)} of {len(jobs)} wrote other text than alone: {differ}"
