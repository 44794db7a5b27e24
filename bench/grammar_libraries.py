"""Why llguidance: llguidance 1.9.1 against xgrammar 0.2.8 on SmolLM2-135M's tokenizer (49,152
tokens): tokenizer build, a schema's first compile, per-token masks (docs/structured-output.md).

xgrammar pulls torch and triton (~1.75 GB), so it is not in the project's requirements: run this in
a throwaway venv that has both libraries, with the tokenizer directory a worker saved:
    python3 -m venv /tmp/xgvenv && /tmp/xgvenv/bin/pip install xgrammar==0.2.8 llguidance==1.9.1 \
        transformers==5.23.0 tokenizers==0.23.3 torch==2.13.0
    /tmp/xgvenv/bin/python bench/grammar_libraries.py ~/.cache/storyteller/tokenizer-<digest>
"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
import llguidance, llguidance.hf, llguidance.torch
import xgrammar as xgr

TOK_DIR = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/storyteller/tokenizer-282dc15dcfb1f5c1"
hf = AutoTokenizer.from_pretrained(TOK_DIR)
V = len(hf)
NPC = {"type": "object", "properties": {
    "line": {"type": "string", "minLength": 1, "maxLength": 200},
    "mood": {"enum": ["grumpy", "cheerful", "scared"]},
    "gold_offered": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["line", "mood", "gold_offered"], "additionalProperties": False}
def big(n, salt=0):
    return {"type": "object", "properties": {f"f{salt}_{i}": (
        {"type": "string", "maxLength": 40} if i % 3 == 0 else {"type": "integer", "minimum": -i, "maximum": 1000 + i}
        if i % 3 == 1 else {"enum": [f"v{i}_{j}" for j in range(20)]}) for i in range(n)},
        "required": [f"f{salt}_{i}" for i in range(n)], "additionalProperties": False}
REPLY = '{"line":"Go away, stranger, the inn is full tonight and the stables too.","mood":"grumpy","gold_offered":40}'
def big_reply(n, salt=0):
    return json.dumps({f"f{salt}_{i}": ("abc" if i % 3 == 0 else i if i % 3 == 1 else f"v{i}_3") for i in range(n)},
                      separators=(",", ":"))
def ms(s): return f"{s*1e3:.1f} ms"
def us(s): return f"{s*1e6:.0f} us"

# Tokenizer builds
t = time.perf_counter(); ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=V); ll_build = time.perf_counter() - t
t = time.perf_counter(); xg_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V); xg_build = time.perf_counter() - t
print(f"tokenizer build: llguidance {ms(ll_build)}, xgrammar TokenizerInfo {ms(xg_build)}")

def run(name, schema, reply, salt_fn):
    ids = hf(reply, add_special_tokens=False).input_ids + [hf.eos_token_id]
    # first compile: a fresh schema each repeat (a salt in a description), no cache
    llc, xgc, llm_first, xgm_first = [], [], [], []
    for rep in range(3):
        s = salt_fn(rep)
        text = json.dumps(s)
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(ll_tok, g)
        bm = llguidance.torch.allocate_token_bitmask(1, V)
        llguidance.torch.fill_next_token_bitmask(m, bm, 0)
        llc.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
        compiler = xgr.GrammarCompiler(xg_info, max_threads=2, cache_enabled=False)
        t = time.perf_counter()
        cg = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
        xm = xgr.GrammarMatcher(cg)
        xbm = xgr.allocate_token_bitmask(1, V)
        xm.fill_next_token_bitmask(xbm)
        xgc.append(time.perf_counter() - t)
    print(f"{name} ({len(json.dumps(schema))} B): first compile + first mask: llguidance {ms(statistics.median(llc))}"
          f" (runs {', '.join(ms(x) for x in llc)}), xgrammar {ms(statistics.median(xgc))} (runs {', '.join(ms(x) for x in xgc)})")
    # per-token mask along the same valid reply
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    compiler = xgr.GrammarCompiler(xg_info, max_threads=2)
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True)
    for lib in ("llguidance", "xgrammar"):
        times = []
        for rep in range(5):
            if lib == "llguidance":
                m = llguidance.LLMatcher(ll_tok, g); bm = llguidance.torch.allocate_token_bitmask(1, V)
                for tok in ids:
                    t = time.perf_counter(); llguidance.torch.fill_next_token_bitmask(m, bm, 0); times.append(time.perf_counter() - t)
                    assert (bm[0, tok // 32] >> (tok % 32)) & 1, (lib, tok)
                    assert m.consume_token(tok), m.get_error()
            else:
                m = xgr.GrammarMatcher(cg); bm = xgr.allocate_token_bitmask(1, V)
                for tok in ids:
                    t = time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter() - t)
                    assert (bm[0, tok // 32] >> (tok % 32)) & 1, (lib, tok)
                    assert m.accept_token(tok), (lib, tok)
        times.sort()
        print(f"  {lib}: per-token mask over {len(ids)} tokens x5: median {us(statistics.median(times))}, "
              f"mean {us(statistics.mean(times))}, p90 {us(times[int(len(times)*.9)])}, max {us(times[-1])}")

run("NPC schema (enum, integer range, bounded string)", NPC, REPLY,
    lambda r: {**NPC, "description": f"npc {r}"})
run("200-field schema", big(200), big_reply(200), lambda r: big(200, 100 + r) if False else {**big(200), "description": f"b {r}"})
for label, line in (("maxLength 12", {"type": "string", "minLength": 1, "maxLength": 12}), ("unbounded string", {"type": "string"})):
    s = {**NPC, "properties": {**NPC["properties"], "line": line}}
    run(f"NPC schema, line {label}", s, REPLY.replace("Go away, stranger, the inn is full tonight and the stables too.", "Go away.") if "12" in label else REPLY,
        lambda r, s=s: {**s, "description": f"npc {r}"})
