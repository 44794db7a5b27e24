"""The continuous engine's model code for each family computes what transformers' does.

A tiny random model of each family (tests/tiny_models.py: llama with llama3 rope and its own head,
mistral's sliding window, qwen2's biases, qwen3's q/k norms and wide heads, gemma3's local and
global layers, phi3's fused products and partial rotary), saved with SmolLM2's tokenizer as a
directory and loaded as the worker loads it. Prompts shorter and longer than the windows (mistral
24, gemma3 16) run together through small blocks and small prefill chunks: every token's logits
equal transformers' forward of the same text in float32, and the greedy text equals its generate(),
with the C++ kernels (the whole step in the C++ decoder) and without (torch's layers, SDPA for the
chunks). Then what the engine says of itself: "+invariant" with a crowd check, the cache's shape,
the sliding-window and longrope lines in the log, and what it refuses.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, LlamaConfig, Phi3Config

from shared.protocol import Job, SamplingParams
from shared.settings import Settings
from tests.engines import run_until_idle
from tests.tiny_models import FAMILIES, family_config, save_family
from worker.continuous import engine as continuous
from worker.continuous import models
from worker.continuous.attention import KVCache
from worker.model_loader import load

# Blocks of 4 tokens and chunks of 8 (12 tokens a step): the prompts span many blocks and split.
# The cache in the model's dtype: these tests hold the model code to transformers' float32 numbers
# (a float16 cache's rounding, engine.cache_dtype's auto on a CPU without bf16, is tested on its own).
SETTINGS = Settings(block_size=4, kv_blocks=512, max_batch_tokens=12, prefill_chunk=8, batch=0, kv_dtype="model")
NO_KERNELS = replace(SETTINGS, cache_dir="")  # engine.build builds no C++ kernels without a cache
LENGTHS = (3, 13, 20, 41, 70)  # around and past the windows (16, 24) and the chunks
NEW = 10  # tokens written by each


def prompt(length: int, salt: int = 0) -> list[int]:
    return [100 + (37 * i + 11 * salt) % 3000 for i in range(length)]


def job(name: str, ids: list[int], new: int = NEW) -> Job:
    return Job(id=name, model="m", prompt_ids=ids, params=SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
               timeout_s=600)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {kind: save_family(kind, str(root / kind), smollm2_tokenizer) for kind in FAMILIES}


@pytest.fixture(scope="module")
def loaded_family(family_dirs):
    """Each family's model loaded in float32 (and bfloat16) on the CPU, once per module."""
    cache = {}

    def get(kind: str, dtype: str = "float32"):
        if (kind, dtype) not in cache:
            cache[kind, dtype] = load(family_dirs[kind], dtype=dtype, device="cpu")
        return cache[kind, dtype]
    return get


def build(loaded, settings: Settings = SETTINGS):
    engine = continuous.build(loaded, settings, loaded.weights(), loaded.config)
    assert engine is not None, "the family runs on the continuous engine"
    return engine


def write_with_logits(engine, jobs: list[Job]) -> tuple[dict, dict]:
    """Every job added at once and stepped to the end: each one's tokens, and the logits each of
    its tokens was picked from ([tokens, vocab]), as the model gave them to the sampler."""
    model, runner = engine.runner.model, engine.runner
    given, logits, run = [], {}, runner.run

    def spy_logits(hidden, _own=model.logits):
        given.append(_own(hidden))
        return given[-1]

    def spy_run(plan):
        given.clear()
        produced = run(plan)
        for (req, _, _), row in zip(produced, given[-1] if given else []):
            logits.setdefault(req.seq.job.id, []).append(row)
        return produced
    model.logits, runner.run = spy_logits, spy_run
    seqs = {j.id: engine.add(j) for j in jobs}
    run_until_idle(engine, most_steps=500)
    return {i: s.output_ids for i, s in seqs.items()}, {i: torch.stack(rows) for i, rows in logits.items()}


@pytest.fixture(scope="module")
def reference(loaded_family):
    """transformers' greedy text of each family's prompts, computed once."""
    cache = {}

    def get(kind: str, length: int) -> list[int]:
        if (kind, length) not in cache:
            model = loaded_family(kind).model
            ids = torch.tensor([prompt(length)])
            with torch.no_grad():
                out = model.generate(ids, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
            cache[kind, length] = out[0, length:].tolist()
        return cache[kind, length]
    return get


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_and_greedy_text_equal_transformers(kind, kernels, loaded_family, reference, request):
    loaded = loaded_family(kind)
    if kernels == "cpp":
        request.getfixturevalue("kernel")  # fails the test where the C++ kernels do not build
    engine = build(loaded, SETTINGS if kernels == "cpp" else NO_KERNELS)
    assert (engine.runner.kernel is not None) == (kernels == "cpp")
    if kernels == "cpp":
        assert engine.runner.model.rows_decoder(engine.runner.kernel), "the whole step runs in the C++ decoder"
    written, logits = write_with_logits(engine, [job(f"p{n}", prompt(n)) for n in LENGTHS])
    for n in LENGTHS:
        tokens = written[f"p{n}"]
        with torch.no_grad():  # the same text at once: its last prompt position and every new token's
            ref = loaded.model(torch.tensor([prompt(n) + tokens[:-1]])).logits[0, n - 1:]
        assert logits[f"p{n}"].shape == ref.shape
        assert (logits[f"p{n}"] - ref).abs().max().item() < 1e-4, (kind, n)
        assert tokens == reference(kind, n), (kind, n)
    assert engine.blocks.free == engine.blocks.num_blocks, "every block came back"


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_the_windows_change_the_logits_of_long_prompts(kind, loaded_family):
    """The comparison above sees the windows: without them transformers' logits differ."""
    loaded = loaded_family(kind)
    config = family_config(kind, loaded.vocab_size, loaded.tokenizer.eos_token_id, loaded.pad_id)
    config.sliding_window = 4096
    unwindowed = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    unwindowed.load_state_dict(loaded.model.state_dict())
    ids = torch.tensor([prompt(LENGTHS[-1])])
    with torch.no_grad():
        assert (loaded.model(ids).logits - unwindowed(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_invariant_and_a_request_writes_the_same_alone_and_in_a_crowd(kind, dtype, loaded_family, kernel):
    loaded = loaded_family(kind, dtype)
    alone = build(loaded)
    assert alone.numerics.endswith("+invariant"), alone.numerics
    target = job("target", prompt(30, salt=1), new=12)
    mine = write_with_logits(alone, [target])[0]["target"]
    crowd = build(loaded)
    steps, run = [], crowd.runner.run
    crowd.runner.run = lambda plan: steps.append({r.seq.job.id for r, _ in plan}) or run(plan)
    others = [job(f"o{i}", prompt(n, salt=2 + i), new=12) for i, n in enumerate((1, 5, 17, 26, 44))]
    together = write_with_logits(crowd, others[:3] + [target] + others[3:])[0]  # its steps shared with others
    assert any("target" in ids and len(ids) > 1 for ids in steps), "the target shared its steps"
    assert together["target"] == mine


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_kv_cache_is_sized_from_the_models_own_layers_heads_and_head_dim(kind, loaded_family):
    loaded = loaded_family(kind)
    config = loaded.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    engine = build(loaded, replace(NO_KERNELS, kv_blocks=0, kv_memory=8))
    shape = engine.runner.cache.k.shape
    assert shape[0] == config.num_hidden_layers and shape[1] == config.num_key_value_heads
    assert shape[3] == 4 and shape[4] == head_dim
    per_token = KVCache.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.float32)
    assert shape[2] == 8 * (1 << 20) // (4 * per_token)
    # --kv-dtype auto with --dtype auto, where that computes in float32: a float16 cache holds twice
    # the tokens, and the fingerprint says so (workers whose texts differ by it are told apart)
    half = build(loaded, replace(NO_KERNELS, kv_blocks=0, kv_memory=8, kv_dtype="auto", dtype="auto"))
    assert half.runner.cache.k.dtype == torch.float16 and half.runner.cache.k.shape[2] == 8 * (1 << 20) // (2 * per_token)
    assert "float32+kv-float16" in half.numerics and "kv-" not in engine.numerics
    if kind == "qwen3":
        assert head_dim != config.hidden_size // config.num_attention_heads  # 96, not 64


def test_the_log_says_how_sliding_windows_run(loaded_family, caplog):
    with caplog.at_level(logging.INFO, logger="worker.continuous.engine"):
        build(loaded_family("gemma3"), NO_KERNELS)
        build(loaded_family("mistral"), NO_KERNELS)
    text = caplog.text
    assert "5 of 6 layers are sliding-window layers: they attend to their last 16 tokens; their blocks are " \
           "kept for the global layers" in text
    assert "every layer attends to its last 24 tokens (sliding window); blocks outside the window are kept" in text


ROTARY = {"llama": "llama.modeling_llama.LlamaRotaryEmbedding", "mistral": "mistral.modeling_mistral.MistralRotaryEmbedding",
          "qwen2": "qwen2.modeling_qwen2.Qwen2RotaryEmbedding", "qwen3": "qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
          "gemma3": "gemma3.modeling_gemma3.Gemma3RotaryEmbedding", "phi3": "phi3.modeling_phi3.Phi3RotaryEmbedding"}


def scaled_configs():
    """Each family's tiny config, and Llama's and Phi-3's with the other scaled ropes transformers
    initialises (linear, yarn; longrope's short factors with a partial rotary)."""
    configs = [(kind, family_config(kind, 512, 0, 1)) for kind in FAMILIES]
    llama = family_config("llama", 512, 0, 1).to_dict()
    for params in (dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
                   dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)):
        configs.append(("llama", LlamaConfig(**{**llama, "rope_parameters": params})))
    phi3 = family_config("phi3", 512, 0, 1)
    rotary = int(phi3.hidden_size // phi3.num_attention_heads * 0.75) // 2
    configs.append(("phi3", Phi3Config(**{**phi3.to_dict(), "original_max_position_embeddings": 64, "rope_parameters": dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75, original_max_position_embeddings=64,
        short_factor=[1.0 + i / 10 for i in range(rotary)], long_factor=[4.0 + i for i in range(rotary)])})))
    return configs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_transformers_rotary_embeddings_bit_for_bit(dtype):
    """The engine makes its rope tables itself (the modelling modules cost a worker ~100 MiB to
    import): every family's, every layer kind's and every scaled rope's equal transformers' own."""
    import importlib
    from worker.continuous.models.decoder import rope_tables
    positions = torch.arange(64)
    for kind, config in scaled_configs():
        module, name = ROTARY[kind].rsplit(".", 1)
        rotary = getattr(importlib.import_module("transformers.models." + module), name)(config)
        for layer_type in sorted(set(getattr(config, "layer_types", None) or [None]), key=str):
            extra = (layer_type,) if kind == "gemma3" else ()
            want = rotary(torch.zeros((), dtype=dtype), positions[None], *extra)
            got = rope_tables(config, layer_type, positions, dtype)
            for w, g in zip(want, got):
                assert g.dtype == dtype and torch.equal(w[0], g), (kind, config.rope_parameters, layer_type)


def test_longrope_caps_the_context_where_the_short_factors_apply(tmp_path, smollm2_tokenizer, caplog):
    """Phi-3.5's rope: transformers switches every position to the long factors once the text
    passes original_max_position_embeddings; the engine stops there, and says so."""
    tok = smollm2_tokenizer
    config = family_config("phi3", len(tok), tok.eos_token_id, tok.pad_token_id)
    rotary = int(config.hidden_size // config.num_attention_heads * 0.75) // 2
    config = Phi3Config(**{**config.to_dict(), "original_max_position_embeddings": 64, "rope_parameters": dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75, original_max_position_embeddings=64,
        short_factor=[1.0 + i / 10 for i in range(rotary)], long_factor=[4.0 + i for i in range(rotary)])})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load(str(tmp_path), dtype="float32", device="cpu")
    with caplog.at_level(logging.INFO, logger="worker.continuous.engine"):
        engine = build(loaded, NO_KERNELS)
    assert loaded.context_window == 64  # what the worker advertises (WorkerInfo.context_window)
    assert "longrope: the context is capped to original_max_position_embeddings (64 of 256 tokens)" in caplog.text
    written, logits = write_with_logits(engine, [job("p", prompt(40), new=20)])
    with torch.no_grad():
        ref = model(torch.tensor([prompt(40) + written["p"][:-1]])).logits[0, 39:]
    assert (logits["p"] - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="the model takes 1 to 63"):
        engine.add(job("long", prompt(64)))


def test_gemma3s_multimodal_config_runs_its_text_part(loaded_family, caplog):
    """A "gemma3" config (the multimodal model's) with its text model's tensors under
    model.language_model.*: the same model as gemma3_text."""
    loaded = loaded_family("gemma3")
    tensors = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in loaded.weights().items()}
    config = Gemma3Config(text_config=loaded.config.to_dict())
    assert models.unsupported(config) is None
    with caplog.at_level(logging.INFO, logger="worker.continuous.engine"):
        engine = continuous.build(loaded, NO_KERNELS, tensors, config)
    assert "its text model runs, images are not read" in caplog.text
    text = build(loaded, NO_KERNELS)
    jobs = [job("a", prompt(30))]
    assert write_with_logits(engine, jobs)[0] == write_with_logits(text, jobs)[0]


def test_what_the_model_code_refuses_is_named_and_no_engine_is_built(loaded_family, caplog):
    tiny = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    dynamic = LlamaConfig(**tiny, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    assert "dynamic rope" in models.unsupported(dynamic)
    capped = family_config("gemma3", 512, 0, 1)
    capped.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in models.unsupported(capped)
    capped.final_logit_softcapping, capped.attn_logit_softcapping = None, 50.0
    assert "attn_logit_softcapping" in models.unsupported(capped)
    assert "biases" in models.unsupported(LlamaConfig(**tiny, attention_bias=True))
    assert "no compact model code for 'falcon'" in models.unsupported(type("C", (), {"model_type": "falcon"})())
    for kind in FAMILIES:
        assert models.unsupported(family_config(kind, 512, 0, 1)) is None, kind
    loaded = loaded_family("gemma3")
    with caplog.at_level(logging.WARNING, logger="worker.continuous.engine"):  # the worker then runs the static one
        assert continuous.build(loaded, NO_KERNELS, loaded.weights(), capped) is None
    assert "cannot run this model (attn_logit_softcapping (logit soft-capping))" in caplog.text
