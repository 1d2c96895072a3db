"""`hetserve bench autocomplete`: an editor's fill-in-the-middle requests replayed against a
running server's `/infill` (hetserve's, or llama.cpp's `llama-server`: the same requests).

The editor is llama.vscode's model of one: a person types --lines lines of a file (by default
the standard library's textwrap.py from line 206, with its fnmatch.py and colorsys.py as the
repository context in `input_extra`: code that does not change with hetserve, the same for
every server in one sitting), word by word at --chars-per-second. After each word the editor sends
a streaming request: `input_prefix` the file's --prefix-lines lines before the cursor's line,
`prompt` what was typed of that line, `input_suffix` the --suffix-lines lines after it. When the
person types the next word, a request still running is cancelled (the client closes its
connection, as the editor does); at the end of a line the person waits for the suggestion (up
to --patience-s) before typing on. Greedy, --n-predict tokens at most.

Reported over the requests that completed: time to the first token (TTFT) and to the last (a
complete suggestion), p50 and p99, separately for the line ends (where the person waited), the
prompt tokens the server's cache supplied (`tokens_evaluated` less `timings.prompt_n`), and how
many requests were cancelled. No tokenizer is needed here: the text goes as text.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import textwrap
import time
from pathlib import Path

_STDLIB = Path(textwrap.__file__).parent
DEFAULT_FILE = _STDLIB / "textwrap.py"
DEFAULT_EXTRA = (_STDLIB / "fnmatch.py", _STDLIB / "colorsys.py")
_WORD_END = re.compile(r"[\s(\[{.,:=]")


def typing_points(line: str) -> list[int]:
    """Where in a line the person pauses and the editor asks: after each word (a space or
    punctuation just typed) and at the line's end; none in its leading indentation."""
    start = len(line) - len(line.lstrip())
    points = [i + 1 for i in range(start, len(line) - 1)
              if _WORD_END.match(line[i]) and not _WORD_END.match(line[i + 1])]  # ", " is one pause
    return points + [len(line)] if line.strip() else []


def requests(text: str, start_line: int, lines: int, prefix_lines: int, suffix_lines: int):
    """(body fields, chars typed since the previous point, whether it ends a line) for each
    point, in the order they are typed."""
    all_lines = text.splitlines(keepends=True)
    out = []
    for n in range(start_line, min(start_line + lines, len(all_lines))):
        line = all_lines[n].rstrip("\n")
        prefix = "".join(all_lines[max(0, n - prefix_lines):n])
        suffix = "\n" + "".join(all_lines[n + 1:n + 1 + suffix_lines])
        last = 0
        for p in typing_points(line):
            out.append(({"input_prefix": prefix, "prompt": line[:p], "input_suffix": suffix}, p - last,
                        p == len(line)))
            last = p
    return out


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    s = sorted(values)
    return {"p50_ms": round(1e3 * statistics.median(s), 2), "p99_ms": round(1e3 * s[min(len(s) - 1, int(0.99 * len(s)))], 2),
            "n": len(s)}


async def _one(client, url: str, body: dict, headers: dict) -> dict:
    """One streaming /infill request: its first and last token times, and the prompt tokens the
    server says it took from its cache: its last event's tokens_evaluated (the prompt's length)
    less timings.prompt_n (those it computed), as llama.cpp and hetserve both report them."""
    t0 = time.perf_counter()
    first = last = None
    final: dict = {}
    predicted = 0
    async with client.stream("POST", url + "/infill", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"ok": False, "error": str(data["error"])[:200]}
            now = time.perf_counter()
            if data.get("content"):
                first = first or now
                last = now
            if data.get("stop"):
                final = data
                predicted = data.get("tokens_predicted") or predicted
    end = time.perf_counter()
    evaluated = final.get("tokens_evaluated") or 0
    computed = (final.get("timings") or {}).get("prompt_n", evaluated)
    return {"ok": True, "ttft": (first or end) - t0, "total": (last or end) - t0, "predicted": predicted,
            "cached": evaluated - computed, "evaluated": evaluated, "content": final.get("content")}


async def _run(args) -> dict:
    import httpx

    text = Path(args.file).read_text()
    extra = [{"filename": Path(p).name, "text": Path(p).read_text()} for p in args.extra]
    points = requests(text, args.start_line, args.lines, args.prefix_lines, args.suffix_lines)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    common = {"input_extra": extra, "n_predict": args.n_predict, "stream": True, "temperature": 0.0, "top_k": 1,
              "cache_prompt": True, "filename": Path(args.file).name}
    if args.model:
        common["model"] = args.model
    results, cancelled, failed, errors = [], 0, 0, []
    # A connection per request, as an editor's plugin opens them: no keep-alive connection that
    # a server closed between requests can fail one.
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.patience_s + 60),
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        # One request first, not counted: the servers' first request pays for things a person's
        # session has paid long before (the repository context's first prefill).
        warm = {**common, **points[0][0]}
        await _one(client, args.url, warm, headers)
        t_start = time.perf_counter()
        for i, (fields, _, line_end) in enumerate(points):
            task = asyncio.ensure_future(_one(client, args.url, {**common, **fields}, headers))
            # The person's next keystrokes: the next word's characters, or after a line end the
            # wait for the suggestion (up to the patience) and then the next line's first word.
            gap = points[i + 1][1] / args.chars_per_second if i + 1 < len(points) else 0.0
            if line_end:
                done, _ = await asyncio.wait({task}, timeout=args.patience_s)
                await asyncio.sleep(gap)
            else:
                done, _ = await asyncio.wait({task}, timeout=gap)
            if task in done:
                r = task.result()
                if r["ok"]:
                    results.append({**r, "line_end": line_end})
                else:
                    failed += 1
                    errors.append(r["error"])
            else:  # the person typed on: the editor drops the request
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                cancelled += 1
        duration = time.perf_counter() - t_start
    evaluated = sum(r["evaluated"] or 0 for r in results)
    cached = sum(r["cached"] or 0 for r in results)
    ends = [r for r in results if r["line_end"]]
    return {
        "benchmark": "autocomplete", "url": args.url, "file": str(args.file), "lines": args.lines,
        "requests": len(points), "completed": len(results), "cancelled": cancelled, "failed": failed,
        "errors": sorted(set(errors))[:5], "duration_s": round(duration, 2),
        "chars_per_second": args.chars_per_second, "n_predict": args.n_predict,
        "ttft": _percentiles([r["ttft"] for r in results]), "complete": _percentiles([r["total"] for r in results]),
        "line_end_ttft": _percentiles([r["ttft"] for r in ends]),
        "line_end_complete": _percentiles([r["total"] for r in ends]),
        "mean_tokens_predicted": round(statistics.mean(r["predicted"] for r in results), 1) if results else None,
        "prompt_tokens": evaluated, "cached_tokens": cached,
        "cache_hit_rate": round(cached / evaluated, 4) if evaluated else None,
        "command": " ".join(sys.argv),
    }


def main(args) -> int:
    report = asyncio.run(_run(args))
    print(f"{report['requests']} requests in {report['duration_s']:.1f}s: {report['completed']} completed, "
          f"{report['cancelled']} cancelled (typed on), {report['failed']} failed")
    for key in ("ttft", "complete", "line_end_ttft", "line_end_complete"):
        v = report[key]
        if v["n"]:
            print(f"{key:>18}: p50 {v['p50_ms']:.1f} ms  p99 {v['p99_ms']:.1f} ms  (n={v['n']})")
    if report["cache_hit_rate"] is not None:
        print(f"prefix cache: {report['cached_tokens']} of {report['prompt_tokens']} prompt tokens "
              f"({100 * report['cache_hit_rate']:.1f}%); mean {report['mean_tokens_predicted']} tokens a suggestion")
    if report["errors"]:
        print("errors:", report["errors"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if report["failed"] == 0 else 1


def add_parser(sub) -> None:
    p = sub.add_parser("autocomplete", help="replay an editor's /infill requests against a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--file", default=str(DEFAULT_FILE), help="the file typed (default: the standard library's textwrap.py)")
    p.add_argument("--extra", nargs="*", default=[str(p) for p in DEFAULT_EXTRA],
                   help="other files sent as input_extra (the repository context)")
    p.add_argument("--start-line", type=int, default=205, help="the first line typed (0-based)")
    p.add_argument("--lines", type=int, default=16)
    p.add_argument("--prefix-lines", type=int, default=256, help="lines before the cursor sent (llama.vscode's 256)")
    p.add_argument("--suffix-lines", type=int, default=64, help="lines after the cursor sent (llama.vscode's 64)")
    p.add_argument("--chars-per-second", type=float, default=6.0, help="typing pace (6: about 70 words a minute)")
    p.add_argument("--patience-s", type=float, default=10.0, help="how long the person waits at a line's end")
    p.add_argument("--n-predict", type=int, default=64)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
