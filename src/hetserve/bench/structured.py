"""`hetserve bench structured`: what structured outputs cost, and how well tools get called.

Throughput: a batch of 8 requests constrained by a JSON schema against the same 8 prompts
unconstrained, each unconstrained request running exactly as many tokens as its constrained twin
produced (EOS ignored), so both batches run the same steps; alternated --runs times, medians.
The mask's own cost is timed inside the engine (GrammarState.allowed) per masked row.
Compile: llguidance's tokenizer view (built once per engine), a schema's first compile, a cache hit.
Tools (--tools): on a fixed set of prompts, how often the model's answer holds the right call
(the expected function, arguments valid for its schema with the expected values) with no
constraint (tools only shown in the template), with the lazy `auto` grammar and with `required`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
TOPICS = ["a backend engineer", "a product manager", "a UX designer", "a data engineer", "a team lead",
          "an intern", "a security engineer", "a frontend developer"]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email",
     "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                      "body": {"type": "string"}},
                    "required": ["to", "subject", "body"]}}},
]
# (prompt, function, {argument: a substring its value must contain, case-insensitive})
TOOL_PROMPTS = [
    ("What's the weather in Paris right now?", "get_weather", {"city": "paris"}),
    ("Is it raining in Tokyo? Use fahrenheit.", "get_weather", {"city": "tokyo"}),
    ("How cold is it in Oslo today?", "get_weather", {"city": "oslo"}),
    ("Tell me the temperature in Cairo in celsius.", "get_weather", {"city": "cairo"}),
    ("Search the web for the latest Python release.", "search_web", {"query": "python"}),
    ("Look up who won the 2022 World Cup.", "search_web", {"query": "world cup"}),
    ("Find recent news about the Rust language.", "search_web", {"query": "rust"}),
    ("Email bob@example.com that the meeting moved to 3pm, subject 'Meeting'.", "send_email",
     {"to": "bob@example.com"}),
    ("Send an email to alice@example.com saying thanks for the review, subject Thanks.", "send_email",
     {"to": "alice@example.com"}),
    ("Write to ops@example.com with subject 'Outage' that the server is down.", "send_email",
     {"to": "ops@example.com"}),
]


def _compile_times(llm, n: int = 5) -> dict:
    from ..structured import StructuredOutputs
    from ..structured.compiler import build_tokenizer

    compiler, tok = llm.engine.structured.compiler, llm.tokenizer
    t = time.perf_counter()  # built again, uncached: the engine built its own while loading
    build_tokenizer(tok.to_json(), compiler.vocab_size, tuple(sorted(tok.stop_token_ids)))
    tokenizer_s = time.perf_counter() - t
    cold, hit = [], []
    for i in range(n):
        schema = dict(SCHEMA, title=f"variant {i}")  # a distinct grammar each time: a cache miss
        spec = StructuredOutputs.json_schema(schema)
        t = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.compile(spec)
        hit.append(time.perf_counter() - t)
    return {"tokenizer_s": round(tokenizer_s, 3), "schema_compile_ms": round(statistics.median(cold) * 1e3, 3),
            "cache_hit_ms": round(statistics.median(hit) * 1e3, 3)}


class _MaskTimer:
    """Times GrammarState.allowed (the mask of one row) inside the engine."""

    def __init__(self):
        from ..structured import matcher

        self.cls, self.real, self.seconds, self.calls = matcher.GrammarState, matcher.GrammarState.allowed, 0.0, 0

        def timed(state, drafts=()):
            t = time.perf_counter()
            try:
                return self.real(state, drafts)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        self.cls.allowed = timed

    def close(self):
        self.cls.allowed = self.real


def _throughput(llm, runs: int, max_tokens: int) -> dict:
    from ..sampling_params import SamplingParams
    from ..structured import StructuredOutputs

    spec = StructuredOutputs.json_schema(SCHEMA)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Invent an employee record for {t} as JSON."}])
               for t in TOPICS]
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec)
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # warm-up (and the grammar's first compile)
    rates = {"masked": [], "unmasked": []}
    timer = _MaskTimer()
    mask_s, mask_rows, valid = 0.0, 0, 0
    try:
        for _ in range(runs):
            timer.seconds, timer.calls = 0.0, 0
            t = time.perf_counter()
            outs = llm.generate(prompts, constrained, use_tqdm=False)
            dt = time.perf_counter() - t
            mask_s, mask_rows = mask_s + timer.seconds, mask_rows + timer.calls
            lengths = [len(o.token_ids) for o in outs]
            rates["masked"].append(sum(lengths) / dt)
            valid += sum(_valid_json(o.text) for o in outs)
            plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
            t = time.perf_counter()
            outs = llm.generate(prompts, plain, use_tqdm=False)
            rates["unmasked"].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    finally:
        timer.close()
    masked, unmasked = statistics.median(rates["masked"]), statistics.median(rates["unmasked"])
    return {"batch": len(prompts), "masked_tok_s": round(masked, 2), "unmasked_tok_s": round(unmasked, 2),
            "ratio": round(masked / unmasked, 3), "mask_ms_per_row": round(mask_s / max(mask_rows, 1) * 1e3, 3),
            "outputs_valid": f"{valid}/{runs * len(prompts)}",
            "runs": {k: [round(v, 2) for v in vs] for k, vs in rates.items()}}


def _valid_json(text: str) -> bool:
    import jsonschema  # the dev extra (make install has it)

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _tool_accuracy(llm, max_tokens: int) -> dict:
    from ..sampling_params import SamplingParams
    from ..serving import tool_calls

    out = {}
    for mode in ("unconstrained", "auto", "required"):
        tools = tool_calls.Tools.parse(TOOLS, None if mode != "required" else "required", False)
        spec = tools.constraint(llm.tokenizer) if mode != "unconstrained" else None
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}], tools=tools.template_tools)
                   for p, _, _ in TOOL_PROMPTS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec),
                            use_tqdm=False)
        right, tagged, missed = 0, 0, []
        for i, (o, (_, fn, expect)) in enumerate(zip(outs, TOOL_PROMPTS)):
            _, calls = tool_calls.parse(o.text, tools)
            tagged += tool_calls.OPEN in o.text
            ok = any(_right(c, fn, expect) for c in calls)
            right += ok
            if not ok:
                missed.append({"prompt": i, "output": o.text[:200]})
        out[mode] = {"correct": f"{right}/{len(TOOL_PROMPTS)}", "wrote_tool_call_tags": tagged, "missed": missed}
    return out


def _right(call: dict, fn: str, expect: dict) -> bool:
    import jsonschema

    if call["function"]["name"] != fn:
        return False
    args = json.loads(call["function"]["arguments"])
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn)
    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    return all(isinstance(args.get(k), str) and v in args[k].lower() for k, v in expect.items())


def main(args) -> int:
    from ..layers import native
    from ..llm import LLM

    llm = LLM(model=args.model, **engine_kwargs(args))
    report = {"model": args.model, "cpu": native.describe(),
              "compile": _compile_times(llm),
              "throughput": _throughput(llm, args.runs, args.max_tokens)}
    if args.tools:
        report["tools"] = _tool_accuracy(llm, args.max_tokens)
    json.dump(report, sys.stdout, indent=2)
    print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="masked vs unmasked batch throughput, schema compile time, tool calls")
    add_model_flag(p)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--tools", action="store_true", help="also score tool calls on a fixed prompt set")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    add_engine_flags(p)
    p.set_defaults(func=main)
