"""Tool calls: request checks, the call grammar, and the parser (whole answers and any chunking of a stream)."""

from __future__ import annotations

import json

import llguidance
import pytest

from hetserve.serving.tool_calls import ToolError, Tools, ToolStream, history_messages, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

CASES = [
    (CALL, None, [("get_weather", {"city": "Oslo"})]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Oslo", "Rome"), "Let me look.",
     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', None, [("get_weather", {"city": "Oslo"})]),
    ('<tools>\n{"name": "get_time", "arguments": {}}\n</tools>', None, [("get_time", {})]),
    ('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"X\\"}"}]', None,
     [("get_time", {}), ("get_weather", {"city": "X"})]),
    ("It is sunny {today}.", "It is sunny {today}.", []),
    ('{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but no call of a known tool
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', '<tool_call>{"name": "launch", "arguments": {}}'
     '</tool_call>', []),  # an unknown tool stays text
    # Cut by max_tokens inside a call: the complete calls stay, the cut one is dropped.
    ("<tool_call>\n{broken", None, []),
    (CALL + "\n" + CALL.replace("Oslo", "Rome")[:40], None, [("get_weather", {"city": "Oslo"})]),
    ("Checking. " + CALL[:30], "Checking.", []),
]


def tools(*fns, choice=None, parallel=None) -> Tools:
    return Tools.parse(list(fns) or [WEATHER, TIME], choice, parallel)


def calls_of(got) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_answers_parse_into_content_and_calls(text, content, calls):
    got_content, got = parse(text, tools())
    assert got_content == content and calls_of(got) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_stream_in_any_chunks_gives_the_same_calls(text, content, calls, size):
    st, out, got = ToolStream(tools()), [], []
    for i in range(0, len(text), size):
        c, k = st.feed(text[i:i + size])
        out.append(c)
        got += k
    c, k = st.feed("", final=True)
    out.append(c)
    got += k
    assert calls_of(got) == calls
    assert "".join(out).strip() == (content or "")


@pytest.mark.parametrize("fns,choice,field,needle", [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "name"),
    ([WEATHER, WEATHER], None, "tools", "twice"),
    ([{"type": "retrieval"}], None, "tools", "function"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
    ([WEATHER], "sometimes", "tool_choice", "tool_choice"),
    ([], "required", "tool_choice", "requires tools"),
])
def test_bad_tools_name_their_field(fns, choice, field, needle):
    with pytest.raises(ToolError, match=needle) as e:
        Tools.parse(fns, choice, None)
    assert e.value.field == field


def test_tool_choice_none_offers_no_tools():
    assert Tools.parse([WEATHER], "none", None) is None and Tools.parse(None, None, None) is None


@pytest.fixture(scope="module")
def lltok(tiny_qwen2):
    from hetserve.core.loading import load_engine
    tok = load_engine(tiny_qwen2, kv_cache_memory="1MiB").tokenizer
    return tok, llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.stop_token_ids))


def _accepts(lltok, spec, text: str) -> bool:
    tok, lt = lltok
    m = llguidance.LLMatcher(lt, spec.grammar(), log_level=0)
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("required", None, CALL, True),
    ("required", None, CALL + "\n" + CALL, True),
    ("required", False, CALL + "\n" + CALL, False),
    ("required", None, "Sure. " + CALL, False),
    ("required", None, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', False),  # city required
    ({"type": "function", "function": {"name": "get_time"}}, None, CALL, False),
    ({"type": "function", "function": {"name": "get_time"}}, None,
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True),
    ("auto", None, "Just text, no call.", True),
    ("auto", None, "Text first. " + CALL + " and after.", True),
    ("auto", None, 'Text <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
])
def test_the_call_grammar(lltok, choice, parallel, text, ok):
    """Literal markers here (the tiny vocabulary has no <tool_call> token)."""
    spec = tools(choice=choice, parallel=parallel).constraint(lltok[0])
    assert _accepts(lltok, spec, text) is ok


def test_history_arguments_become_objects_for_the_template():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    out = history_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and out[1] == msgs[1]
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's data is not changed
