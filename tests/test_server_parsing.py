"""The incremental parser of replies: reasoning, content and tool calls from text split anywhere."""
from __future__ import annotations

import json
import random

import pytest

from kvslim.server.parsing import OutputParser, ParsedReply, parse_reply, thinking_opened

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]

XML_TWO = ("I'll look.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n/etc/hosts\n</parameter>\n"
           "<parameter=limit>\n20\n</parameter>\n<parameter=opts>\n{\"raw\": true}\n</parameter>\n</function>\n"
           "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\nline 2\n"
           "</parameter>\n</function>\n</tool_call>")
JSON_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } in \\"quotes\\""}}\n'
            '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>')

CASES = [
    # (text, thinking_open, tools, reasoning, content, calls)
    ("<think>\nLet me think.\n</think>\n\nThe answer.", False, None, "Let me think.", "The answer.", []),
    ("Plans < and > </thin.\n</think>\n\nDone.", True, None, "Plans < and > </thin.", "Done.", []),
    ("no thinking at all, <b>bold</b>", False, None, "", "no thinking at all, <b>bold</b>", []),
    ("still thinking when cut", True, None, "still thinking when cut", "", []),
    (XML_TWO, False, TOOLS, "", "I'll look.",
     [("read_file", {"path": "/etc/hosts", "limit": 20, "opts": {"raw": True}}),
      ("get_weather", {"city": 'São "Paulo"\nline 2'})]),
    ("<think>\nweather?\n</think>\n\n" + JSON_TWO, False, TOOLS, "weather?", "",
     [("get_weather", {"city": "Oslo", "note": 'a } in "quotes"'}), ("read_file", {})]),
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', False, TOOLS, "", "", [("f", {"a": 1})]),
    ("<tool_call>\nnot a call\n</tool_call>", False, TOOLS, "", "<tool_call>\nnot a call\n</tool_call>", []),
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", False, TOOLS, "", "",
     [("get_weather", {})]),
    ("a <tool_call> tag without tools", False, None, "", "a <tool_call> tag without tools", []),
]


def calls_of(reply: ParsedReply) -> list:
    return [(c["name"], json.loads(c["arguments"])) for c in reply.calls]


def feed_pieces(text: str, cuts: list[int], **kw) -> ParsedReply:
    p, reply, last = OutputParser(**kw), ParsedReply(), 0
    for cut in cuts + [len(text)]:
        reply.add(p.feed(text[last:cut]))
        last = cut
    return reply.add(p.finish())


@pytest.mark.parametrize("text, opened, tools, reasoning, content, calls", CASES)
def test_whole_reply(text, opened, tools, reasoning, content, calls):
    r = parse_reply(text, thinking_open=opened, tools=tools)
    assert (r.reasoning, r.content, calls_of(r)) == (reasoning, content, calls)


@pytest.mark.parametrize("text, opened, tools, reasoning, content, calls", CASES)
def test_any_split_gives_the_same_reply(text, opened, tools, reasoning, content, calls):
    """Every two-piece split, one character at a time, and random splits (tags cut across pieces)."""
    kw = dict(thinking_open=opened, tools=tools)
    want = parse_reply(text, **kw)
    splits = [[i] for i in range(len(text))] + [list(range(1, len(text)))]
    rng = random.Random(0)
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) for _ in range(20)]
    for cuts in splits:
        assert feed_pieces(text, cuts, **kw) == want, cuts


def test_deltas_stream_before_the_call_closes():
    """Arguments are sent while generated: a string parameter's text, a JSON call's partial object."""
    p = OutputParser(tools=TOOLS)
    deltas = p.feed("<tool_call>\n<function=read_file>\n<parameter=path>\n/usr/sh")
    assert [(d.kind, d.name or d.text) for d in deltas] == [("tool_start", "read_file"), ("tool_args", '{"path": "'),
                                                            ("tool_args", "/usr/sh")]
    p = OutputParser(tools=TOOLS)
    deltas = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')
    assert deltas[0].name == "get_weather" and "".join(d.text for d in deltas[1:]) == '{"city": "Os'
    assert "".join(d.text for d in p.feed('lo"}}\n</tool')) == 'lo"}'


def test_tag_split_is_held_back_not_leaked():
    p = OutputParser(thinking_open=True)
    assert [d.text for d in p.feed("idea </thi")] == ["idea"]         # "</thi" may close the block
    assert [(d.kind, d.text) for d in p.feed("nk>\n\nok")] == [("content", "ok")]
    p = OutputParser(tools=TOOLS)
    assert [d.text for d in p.feed("text <tool_")] == ["text"]
    assert [d.kind for d in p.feed("call>\n<function=get_weather>")] == ["tool_start"]


def test_reasoning_off_leaves_thinking_in_content():
    r = parse_reply("<think>\nhm\n</think>\n\nanswer", reasoning=False)
    assert r.reasoning == "" and r.content == "<think>\nhm\n</think>\n\nanswer"


def test_thinking_opened_by_the_prompt():
    assert thinking_opened("<|im_start|>assistant\n<think>\n")
    assert not thinking_opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_opened("<|im_start|>assistant\n")


def test_forced_call_grammars_accept_what_the_parser_reads():
    """The XML grammar (Qwen3.5 templates) and the JSON one (Qwen3), after closing an open thinking block."""
    llguidance = pytest.importorskip("llguidance")
    from pathlib import Path

    from kvslim.server.grammar import CLOSE_THINKING, tool_call_grammar
    from kvslim.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(Path(__file__).resolve().parents[1] / "kvslim" / "data" / "tiny-qwen35")
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=0)
    xml = CLOSE_THINKING + XML_TWO.split("\n\n", 1)[1].split("\n<tool_call>\n<function=get_weather>")[0]
    cases = [(True, xml), (False, CLOSE_THINKING + '<tool_call>\n{"name": "get_weather", "arguments": '
                                                   '{"city": "Oslo"}}\n</tool_call>')]
    for is_xml, text in cases:
        matcher = llguidance.LLMatcher(lltok, tool_call_grammar(TOOLS, None, is_xml, CLOSE_THINKING), log_level=0)
        for token in tok.encode(text, False):
            assert matcher.consume_token(token), (is_xml, tok.decode([token]))
        assert matcher.is_accepting()
        reply = parse_reply(text, thinking_open=True, tools=TOOLS)
        assert reply.reasoning == "" and len(reply.calls) == 1 and json.loads(reply.calls[0]["arguments"])
