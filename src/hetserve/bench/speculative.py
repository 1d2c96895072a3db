"""`hetserve bench speculative`: speculative decoding vs the target alone, per prompt and temperature.

Configurations: target-only, draft-only, fixed K, the adaptive policies, TV budgets at fixed
K = 8; each runs a code-refactoring and a creative-writing chat prompt, --output-tokens tokens
with EOS ignored, at temperature 0 (--runs runs) and 0.7 (--seeds seeds). Reported per cell:
acceptance, verification rounds per request, median E2E, median decode tok/s (output tokens - 1
over E2E - TTFT) and its ratio to target-only on the same prompt and temperature, overall and per
run (run i against target-only's run i, in the same round; the worst is printed). Prefix caching
is off so repeated runs never reuse a prompt's pages.

Every configuration but draft-only runs on ONE engine that holds the target and the draft and
swaps its draft policy and TV budget between runs (EngineCore.set_speculation); target-only is
that engine with a fixed K = 0 policy, which never runs the draft. The runs are interleaved: run
i of every configuration, in an order rotated by one each time, before run i + 1 of any. On a
shared machine the load changes by 15-25% within minutes, so measuring each configuration in
its own block (--blocks, one engine each, as before) moved the ratios by that much between
invocations; interleaved, both sides of a ratio see the same load. draft-only (another model)
runs first in its own engine.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs

PROMPTS = {
    "code": "Refactor this Python function into small, well-named functions with type hints and docstrings; "
            "keep its behaviour exactly:\n\n```python\ndef process(data):\n    out = []\n    for d in data:\n"
            "        if d['status'] == 'active' and d['age'] >= 18:\n            name = d['first'] + ' ' + d['last']\n"
            "            total = 0\n            for o in d['orders']:\n                if o['paid']:\n"
            "                    total += o['amount'] * (1 - o.get('discount', 0))\n"
            "            out.append({'name': name.title(), 'total': round(total, 2)})\n"
            "    out.sort(key=lambda x: -x['total'])\n    return out\n```",
    "creative": "Write a short story about a lighthouse keeper who finds a message in a bottle from "
                "their future self. Use vivid imagery and an unexpected ending.",
}

# name -> engine settings (None: no draft); "draft-only" runs the draft model as the target.
CONFIGS = {
    "target-only": None,
    "draft-only": None,
    "fixed-2": dict(spec_policy="fixed", num_speculative_tokens=2),
    "fixed-3": dict(spec_policy="fixed", num_speculative_tokens=3),
    "fixed-4": dict(spec_policy="fixed", num_speculative_tokens=4),
    "fixed-6": dict(spec_policy="fixed", num_speculative_tokens=6),
    "fixed-8": dict(spec_policy="fixed", num_speculative_tokens=8),
    "acceptance-rate": dict(spec_policy="acceptance-rate", num_speculative_tokens=4),
    "accepted-length": dict(spec_policy="accepted-length", num_speculative_tokens=4),
    "cost": dict(spec_policy="cost", num_speculative_tokens=4),
    "cost-every-k": dict(spec_policy="cost", num_speculative_tokens=4, spec_confidence=0.0),
    "tv-0": dict(spec_policy="fixed", num_speculative_tokens=8, spec_tv_budget=0.0),
    "tv-0.5": dict(spec_policy="fixed", num_speculative_tokens=8, spec_tv_budget=0.5),
    "tv-0.75": dict(spec_policy="fixed", num_speculative_tokens=8, spec_tv_budget=0.75),
    "tv-1": dict(spec_policy="fixed", num_speculative_tokens=8, spec_tv_budget=1.0),
}
# Not run unless named: the short fixed drafts that pay best on a CPU, the yardstick for `cost`,
# and `cost` drafting its whole K every round (no stop on the draft's confidence).
ON_REQUEST = ("fixed-2", "fixed-3", "cost-every-k")


def _load(args, engine_kw: dict, model: str, settings: dict | None):
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    kw = dict(engine_kw, enable_prefix_caching=False, speculative_model=None)
    if settings is not None:
        kw.update(settings, speculative_model=args.draft)
    llm = LLM(model=model, **kw)
    llm.generate([llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    return llm


def _cells(args, name: str) -> list[tuple[str, float, list]]:
    """(prompt, temperature, seeds) of a config; TV budgets only change sampled decoding."""
    cells = []
    for pname in args.prompts:
        for temp in args.temperatures:
            if temp == 0.0 and name.startswith("tv-") and name != "tv-0":
                continue
            cells.append((pname, temp, [None] * args.runs if temp == 0.0 else list(range(args.seeds))))
    return cells


def _run_once(llm, args, pname: str, temp: float, seed) -> dict:
    from ..sampling_params import SamplingParams

    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[pname]}])
    params = SamplingParams(max_tokens=args.output_tokens, temperature=temp, top_p=0.8, top_k=20, seed=seed,
                            ignore_eos=True)
    t = time.monotonic()
    out = llm.generate([ids], params, use_tqdm=False)[0]
    m = out.metrics
    ttft, e2e = m["first_token_time"] - t, m["finished_time"] - t
    spec = m.get("spec_decode", {})
    drafted = bool(spec.get("rounds"))  # target-only (K = 0) verifies nothing: no acceptance to report
    return {"e2e_s": e2e, "ttft_s": ttft, "decode_tok_s": (len(out.token_ids) - 1) / max(e2e - ttft, 1e-9),
            **{key: spec[key] if drafted else None for key in ("acceptance_rate", "rounds", "mean_accepted_length")},
            "k_histogram": spec.get("k_histogram"), "token_ids": out.token_ids}


def _run_blocks(args, engine_kw: dict, names: list[str]) -> dict:
    """Each config in its own engine, its cells one after another."""
    runs = {}
    for name in names:
        print(f"[{name}]", file=sys.stderr, flush=True)
        llm = _load(args, engine_kw, args.draft if name == "draft-only" else args.model, CONFIGS[name])
        for pname, temp, seeds in _cells(args, name):
            runs[(name, pname, temp)] = [_run_once(llm, args, pname, temp, seed) for seed in seeds]
        del llm
        gc.collect()
    return runs


def _run_interleaved(args, engine_kw: dict, names: list[str]) -> dict:
    """One engine with the draft; run i of every config (order rotated each time) before run i + 1."""
    llm = _load(args, engine_kw, args.model, dict(spec_policy="fixed", num_speculative_tokens=2))  # warms the draft
    eng = llm.engine
    settings = {name: (eng.make_spec_policy("fixed", 0), 0.0) if CONFIGS[name] is None else
                (eng.make_spec_policy(CONFIGS[name]["spec_policy"], CONFIGS[name]["num_speculative_tokens"],
                                      CONFIGS[name].get("spec_confidence")),
                 CONFIGS[name].get("spec_tv_budget", 0.0)) for name in names}
    work = [(name, pname, temp, seeds) for name in names for pname, temp, seeds in _cells(args, name)]
    runs = {(name, pname, temp): [] for name, pname, temp, _ in work}
    for i in range(max(len(seeds) for *_, seeds in work)):
        print(f"[run {i + 1}]", file=sys.stderr, flush=True)
        turn = work[i % len(work):] + work[:i % len(work)]
        for name, pname, temp, seeds in turn:
            if i < len(seeds):
                eng.set_speculation(*settings[name])
                runs[(name, pname, temp)].append(_run_once(llm, args, pname, temp, seeds[i]))
    del llm
    gc.collect()
    return runs


def _summary(name: str, prompt: str, temp: float, runs: list[dict]) -> dict:
    def med(key):
        vals = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {"config": name, "prompt": prompt, "temperature": temp, "runs": len(runs),
            "acceptance_rate": med("acceptance_rate"), "rounds": med("rounds"),
            "mean_accepted_length": med("mean_accepted_length"), "e2e_s": med("e2e_s"), "ttft_s": med("ttft_s"),
            "decode_tok_s": med("decode_tok_s"), "decode_tok_s_runs": [round(r["decode_tok_s"], 3) for r in runs],
            "k_histograms": [r["k_histogram"] for r in runs],
            "greedy_tokens": runs[0]["token_ids"] if temp == 0.0 else None}


def main(args) -> int:
    unknown = [c for c in args.configs if c not in CONFIGS] + [p for p in args.prompts if p not in PROMPTS]
    if unknown:
        raise ValueError(f"unknown configs or prompts: {', '.join(unknown)} (configs: {', '.join(CONFIGS)}; "
                         f"prompts: {', '.join(PROMPTS)})")
    configs = ["target-only"] + [c for c in args.configs if c not in ("target-only", "draft-only")]
    report = {"benchmark": "speculative", "model": args.model, "draft": args.draft,
              "output_tokens": args.output_tokens, "command": " ".join(sys.argv),
              "order": "blocks" if args.blocks else "interleaved", "rows": []}
    runs = _run_blocks(args, engine_kwargs(args), ["draft-only"]) if "draft-only" in args.configs else {}
    runs.update((_run_blocks if args.blocks else _run_interleaved)(args, engine_kwargs(args), configs))
    for name in ["target-only"] + [c for c in args.configs if c != "target-only"]:
        for pname, temp, _ in _cells(args, name):
            report["rows"].append(_summary(name, pname, temp, runs[(name, pname, temp)]))
    base = {(r["prompt"], r["temperature"]): r for r in report["rows"] if r["config"] == "target-only"}
    print(f"{'config':<17}{'prompt':<10}{'temp':>5}{'accept':>8}{'rounds':>8}{'E2E s':>9}{'decode tok/s':>14}"
          f"{'ratio':>7}{'worst run':>10}  greedy = target")
    for r in report["rows"]:
        b = base[(r["prompt"], r["temperature"])]
        r["ratio_to_target"] = round(r["decode_tok_s"] / b["decode_tok_s"], 3)
        # Run i of each config ran in round i beside target-only's run i: the ratio per round.
        r["ratio_per_run"] = [round(a / t, 3) for a, t in zip(r["decode_tok_s_runs"], b["decode_tok_s_runs"])]
        same = "" if r["temperature"] else ("yes" if r["greedy_tokens"] == b["greedy_tokens"] else "no")
        if r["config"] == "draft-only":
            same = ""  # a different model: a cost reference only
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        rounds = "-" if r["rounds"] is None else f"{r['rounds']:.0f}"
        print(f"{r['config']:<17}{r['prompt']:<10}{r['temperature']:>5}{acc:>8}{rounds:>8}{r['e2e_s']:>9.2f}"
              f"{r['decode_tok_s']:>14.2f}{r['ratio_to_target']:>7.2f}{min(r['ratio_per_run']):>10.2f}  {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("speculative", help="speculative decoding (policies, TV budgets) vs the target alone")
    add_model_flag(p)
    p.set_defaults(model="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model (registry name or .gguf)")
    p.add_argument("--configs", type=lambda s: s.split(","), default=[c for c in CONFIGS if c not in ON_REQUEST],
                   help=f"comma-separated subset of: {', '.join(CONFIGS)} (target-only always runs; "
                        f"by default all but {', '.join(ON_REQUEST)})")
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(PROMPTS), help="code,creative")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3, help="seeded runs per cell at temperature > 0")
    p.add_argument("--runs", type=int, default=1, help="runs per cell at temperature 0")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--blocks", action="store_true",
                   help="one engine per config, each config's runs in one block (the order before interleaving)")
    add_engine_flags(p)
    p.set_defaults(func=main)
