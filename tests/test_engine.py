"""Engine, sampling, streaming and the public API on a tiny model saved by transformers."""
from __future__ import annotations

import json

import pytest
import torch

import kvslim
import kvslim.tokenizer
from kvslim.cli import main as cli_main
from kvslim.engine import ContextLengthExceeded, Sampler, SamplingParams
from kvslim.engine.sampling import truncation_mask
from kvslim.engine.text import TextStream


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return kvslim.load(tiny_folder("qwen3_5")[0], ctx=256, cache_type_k="f32", cache_type_v="f32",
                       n_parallel=3, n_ubatch=16, dtype="f32")


# ----- sampling -------------------------------------------------------------------
def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert Sampler(SamplingParams(temperature=0))(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1))(logits) == int(logits.argmax())


def test_truncation_keeps_the_nucleus_and_min_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = truncation_mask(logits, SamplingParams(top_k=0, top_p=0.8, min_p=0.0))
    assert keep.tolist() == [True, True, False, False]               # 0.5 + 0.3 reaches 0.8
    keep = truncation_mask(logits, SamplingParams(top_k=0, top_p=1.0, min_p=0.25))
    assert keep.tolist() == [True, True, True, False]                 # 0.05 < 0.25 * 0.5


def test_same_seed_same_tokens_and_distribution_matches_frequencies():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a, b = Sampler(params), Sampler(params)
    draws = [a(logits) for _ in range(4000)]
    assert draws[:50] == [b(logits) for _ in range(50)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.03)


def test_top_p_zero_keeps_only_the_most_likely_token():
    # OpenAI's range includes 0, and llama.cpp keeps one token there: the best, whatever the temperature
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.5, top_p=0, min_p=0, seed=3)
    assert params.greedy and all(Sampler(params)(logits) == int(logits.argmax()) for _ in range(20))
    assert truncation_mask(logits, params).sum() == 1


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([3.0, 2.9, -1.0])
    params = SamplingParams(temperature=0, repeat_penalty=1.5)
    assert Sampler(params)(logits, history=[0]) == 1                  # 3.0 / 1.5 < 2.9


def test_bad_sampling_values_are_refused():
    with pytest.raises(ValueError, match=r"^top_p must be in \[0, 1\] \(got 1.5\)$"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 \(got -1\)$"):   # the value, not every field
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="finite numbers .*'min_p': nan"):
        SamplingParams(min_p=float("nan"))
    with pytest.raises(ValueError, match=r"^seed must be a 64-bit integer \(got 18446744073709551616\)$"):
        SamplingParams(seed=2 ** 64)                                  # was torch's "Overflow when unpacking"
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1


# ----- text ---------------------------------------------------------------------
class _CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_stop_string_cuts_text_and_holds_back_a_possible_start():
    s = TextStream(_CharTokenizer(), ["END"])
    for ch in "abcE":
        assert not s.push(ord(ch))
    assert s.new_text() == "abc"                                       # "E" may start "END"
    assert not s.push(ord("x"))
    assert s.new_text() == "Ex"
    for ch in "yEN":
        s.push(ord(ch))
    assert s.push(ord("D")) and s.text == "abcExy"


def test_a_long_stop_string_holds_back_its_longest_started_prefix():
    stop = "ab" * 5000 + "c"                      # prefixes overlap themselves: KMP's borders, not a fixed shift
    s = TextStream(_CharTokenizer(), [stop])
    for ch in "xx" + "ab" * 7 + "a":
        assert not s.push(ord(ch))
    assert s.new_text() == "xx"                   # "abab...a" may still become the stop string
    s.push(ord("c"))                              # "...abac": no prefix of the stop string ends the text
    assert s.new_text() == "ab" * 7 + "ac"
    s = TextStream(_CharTokenizer(), ["aabzz"])
    for ch in "xaaa":                             # a mismatch at the third "a" falls back to "a", then "aa"
        s.push(ord(ch))
    assert s.new_text() == "xa"


def bundled_tokenizer():
    return kvslim.tokenizer.Tokenizer.from_folder(kvslim.loading.BUNDLED)


def llama2_style_tokenizer():
    """Llama-2's tokenizer.json layout (Metaspace pieces, bytes as <0xXX> tokens, a decoder that
    strips the first space), its BPE trained here on the bundled text: decoding a window of ids
    differs from decoding the whole reply at its start and inside characters, which the stream must undo."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from kvslim.data import TEXT

    text = (TEXT / "classics-heldout.txt").read_text()[:60_000]
    trainer = models.BPE()
    tok = Tokenizer(trainer)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, show_progress=False))
    learnt = json.loads(tok.to_str())["model"]
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({piece: 256 + i for i, piece in enumerate(learnt["vocab"])})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    model = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    model.normalizer = tok.normalizer
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return kvslim.tokenizer.Tokenizer(model)


def streamed(tok, ids: list[int]) -> list[str]:
    """The pieces a stream sends, one a token, then the last at the end."""
    s, pieces = TextStream(tok, []), []
    for i in ids:
        s.push(i)
        pieces.append(s.new_text())
    s.finish()
    pieces.append(s.new_text())
    assert "".join(pieces) == s.text
    return pieces


@pytest.mark.parametrize("make", [bundled_tokenizer, llama2_style_tokenizer])
def test_streamed_text_is_the_decode_of_every_id(make):
    import random
    tok = make()
    reply = " Elle a dit: « déjà vu », 日本語 🙂🙂 and ñ.\n\n  Then   spaces, tabs\tand an end."
    ids = tok.encode(reply * 3, add_special=False)
    pieces = streamed(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and "\ufffd" not in "".join(pieces)   # no half character sent
    # random ids, broken characters among them. Byte fallback's <0xXX> tokens are left out: where a
    # run of them is not UTF-8, its decoder replaces every byte of the run, valid ones too, and the
    # stream has already sent the valid ones it decoded before the broken byte came
    rng = random.Random(0)
    pool = range(256 if make is llama2_style_tokenizer else 0, tok.vocab_size)
    for _ in range(4):
        ids = [rng.choice(pool) for _ in range(400)]
        assert "".join(streamed(tok, ids)) == tok.decode(ids)


def test_a_stop_string_split_across_tokens_cuts_the_text_where_it_starts():
    tok = bundled_tokenizer()
    ids = tok.encode("It was the best of times, it was the worst of times.", add_special=False)
    s = TextStream(tok, ["worst of", "never"])
    hit = next(n for n, i in enumerate(ids, 1) if s.push(i))
    assert tok.decode(ids[:hit]).endswith(("worst of", "worst of "))
    assert s.text == "It was the best of times, it was the "


# ----- generation -----------------------------------------------------------------
def test_greedy_generation_equals_argmax_of_prefill_logits(llm):
    prompt = llm.tokenize("The module provides")
    out = llm.generate(prompt, max_tokens=12, temperature=0)
    ids = list(prompt)
    for _ in range(len(out.token_ids)):                               # teacher-forced re-scoring
        ids.append(int(llm.logits(ids)[-1].argmax()))
    assert out.token_ids == ids[len(prompt):]
    assert out.finish_reason in ("length", "stop") and out.prompt_tokens == len(prompt)


def test_stream_pieces_add_up_to_the_completion(llm):
    chunks = list(llm.generate("Regular expression", max_tokens=20, temperature=0.9, seed=3, stream=True))
    final = chunks[-1].completion
    assert "".join(c.text for c in chunks) == final.text
    assert final.timings["predicted_n"] == len(final.token_ids)
    again = llm.generate("Regular expression", max_tokens=20, temperature=0.9, seed=3)
    assert again.token_ids == final.token_ids                          # same seed, same tokens


def test_batched_generation_equals_each_alone(llm):
    prompts = ["a", "The json module", "Return the value of the"]
    together = llm.generate_batch(prompts, max_tokens=10, temperature=0)
    for p, t in zip(prompts, together):
        assert llm.generate(p, max_tokens=10, temperature=0).token_ids == t.token_ids
    assert llm.engine.n_free_slots == 3                             # every slot released


def test_ignore_eos_runs_past_end_of_generation_to_max_tokens(llm):
    """llama-server's ignore_eos: end-of-generation tokens are never sampled, so a greedy request
    that stopped on one runs to max_tokens instead, its tokens identical up to that point."""
    engine = llm.engine
    for first in range(3, 60):                                         # a prompt whose greedy reply ends early
        stopped = engine.submit([first, first + 1, first + 2], 200, SamplingParams(temperature=0))
        engine.run([stopped])
        engine.release(stopped)
        if stopped.finish_reason == "stop":
            break
    assert stopped.finish_reason == "stop" and len(stopped.generated) < 200
    go_on = engine.submit(stopped.prompt, 200, SamplingParams(temperature=0, ignore_eos=True))
    engine.run([go_on])
    engine.release(go_on)
    assert go_on.finish_reason == "length" and len(go_on.generated) == 200
    assert go_on.generated[:len(stopped.generated)] == stopped.generated
    assert not set(go_on.generated) & engine.eog_ids


def test_stopping_early_frees_the_slot(llm):
    stream = llm.generate("abc", max_tokens=50, stream=True, seed=1)
    next(stream)
    stream.close()
    assert llm.engine.n_free_slots == 3


def test_cache_type_changes_logits_and_memory(tiny_folder):
    folder = tiny_folder("qwen3_5")[0]
    ids = list(range(3, 203))
    exact = kvslim.load(folder, ctx=256, cache_type_k="f32", cache_type_v="f32", dtype="f32")
    q4 = kvslim.load(folder, ctx=256, cache_type_k="q4_0", cache_type_v="turbo3", dtype="f32")
    diff = (exact.logits(ids) - q4.logits(ids)).abs().max().item()
    assert 1e-4 < diff < 1.0                                           # changed, but not destroyed
    done = q4.generate(ids, max_tokens=4, temperature=0)
    kv = q4.engine.cache.kv_layers
    assert done.kv_bytes == len(kv) * 256 * kv[0].spec.bytes_per_token  # one page of q4_0 K + turbo3 V
    assert done.state_bytes == sum(q4.engine.cache[i].spec.bytes_per_slot for i in q4.engine.cache.recurrent)


def test_user_mistakes_get_clear_errors(llm):
    with pytest.raises(ContextLengthExceeded, match="300 tokens"):
        llm.generate([5] * 300, max_tokens=4)
    with pytest.raises(ValueError, match="out of range"):
        llm.logits([1, 10_000])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="unknown sampling option"):
        llm.generate("x", tempurature=1.0)
    assert llm.engine.n_free_slots == 3


def test_chat_template_renders(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_templates_compile_once_per_source_and_keep_their_globals(llm, monkeypatch):
    """Templates are compiled once (the Qwen3.5 one took ~11 ms a request to compile) and
    cached by their source: another template renders as itself, and the sandbox's globals
    (raise_exception) still work from the cached one."""
    tok = llm.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    hits = kvslim.tokenizer._compiled.cache_info().hits
    assert tok.apply_chat_template([{"role": "user", "content": "b"}]) == "[b]"
    assert kvslim.tokenizer._compiled.cache_info().hits == hits + 1
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('no system role here') }}")
    for _ in range(2):
        with pytest.raises(Exception, match="no system role here"):
            tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_run_command_prints_json(tiny_folder, capsys):
    folder = tiny_folder("qwen3_5")[0]
    code = cli_main(["run", "-m", str(folder), "-p", "Hello", "-n", "5", "-c", "64", "-ctk", "q8_0",
                     "-ctv", "turbo4", "--temp", "0", "--dtype", "f32", "-o", "json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["completion_tokens"] <= 5
    assert {"text", "prompt_tps", "gen_tps", "kv_bytes", "state_bytes"} <= set(record)
    assert record["kv_bytes"] > 0 and record["state_bytes"] > 0


def test_run_command_bad_input_is_one_line(tiny_folder, capsys):
    assert cli_main(["run", "-m", str(tiny_folder("llama")[0]), "-p", "x", "-ctk", "q3_0"]) == 2
    assert "unknown KV cache type 'q3_0'" in capsys.readouterr().err


# ----- prefix reuse -----------------------------------------------------------------
def _greedy(engine, prompt, n=8):
    seq = engine.submit(prompt, n, SamplingParams(temperature=0))
    engine.run([seq])
    engine.release(seq)
    return seq


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_prefix_reuse_gives_the_same_tokens_as_a_fresh_start(tiny_folder, kind):
    from kvslim.engine import Engine, EngineConfig
    from kvslim.loading import load_model

    model, tok, _ = load_model(tiny_folder(kind)[0], "f32")
    fresh = Engine(model, tok, EngineConfig.build(256, 2, "f32", "f32", n_ubatch=16))
    reuse = Engine(model, tok, EngineConfig.build(256, 2, "f32", "f32", n_ubatch=16, prefix_cache=True,
                                                  checkpoint_interval=16))
    turn1 = list(range(10, 60))
    first = _greedy(reuse, turn1)
    assert first.generated == _greedy(fresh, turn1).generated
    turn2 = turn1 + first.generated + list(range(70, 90))             # the conversation goes on
    second = _greedy(reuse, turn2)
    # everything the first turn put in the cache (its last sampled token was never fed back)
    assert second.cached_tokens == first.n_cached == len(turn1) + len(first.generated) - 1
    assert second.generated == _greedy(fresh, turn2).generated
    edited = turn1[:37] + [7, 7, 7] + turn1[40:]                        # diverges inside the first prompt
    third = _greedy(reuse, edited)
    expected_reuse = 37 if kind == "llama" else 32                      # KV trims anywhere; state: checkpoint at 32
    assert third.cached_tokens == expected_reuse
    assert third.generated == _greedy(fresh, edited).generated


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_an_f16_window_in_the_c_step_through_prefix_reuse(tiny_folder, kind):
    """--f16-window N with the C step: two requests at once, a conversation that reuses its
    cache and a prompt edited inside the first (a trim into the pages, or a DeltaNet checkpoint
    restored) give the torch step's tokens (the same caches, decoded eagerly)."""
    from kvslim.engine import Engine, EngineConfig
    from kvslim.loading import load_model

    model, tok, _ = load_model(tiny_folder(kind)[0], "f32")
    engines = [Engine(model, tok, EngineConfig.build(256, 2, "q8_0", "turbo4", n_ubatch=16, prefix_cache=True,
                                                     checkpoint_interval=16, f16_window=12, native=native))
               for native in (True, False)]
    assert engines[0].decode_step.path == "native" and engines[1].decode_step.path == "eager"
    turn1 = list(range(10, 60))
    together = []
    for engine in engines:
        pair = [engine.submit(p, 20, SamplingParams(temperature=0)) for p in (turn1, list(range(90, 97)))]
        engine.run(pair)
        for seq in pair:
            engine.release(seq)
        together.append([seq.generated for seq in pair])
    assert together[0] == together[1]
    first = together[0][0]
    for prompt in (turn1 + first + list(range(70, 90)), turn1[:37] + [7, 7, 7] + turn1[40:]):
        got, want = (_greedy(engine, prompt, 16) for engine in engines)
        assert got.cached_tokens == want.cached_tokens > 0
        assert got.generated == want.generated


def test_kvslim_load_reads_gguf_like_the_folder(tiny_folder, tmp_path):
    from kvslim.loading import convert_hf_to_gguf

    folder = tiny_folder("qwen3_5")[0]
    convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32")
    a = kvslim.load(folder, ctx=128, cache_type_k="f32", cache_type_v="f32", dtype="f32")
    b = kvslim.load(tmp_path / "m.gguf", ctx=128, cache_type_k="f32", cache_type_v="f32", dtype="f32")
    ids = a.tokenize("The json module <|im_end|> héllo")
    assert b.tokenize("The json module <|im_end|> héllo") == ids
    assert (a.logits(ids) - b.logits(ids)).abs().max().item() <= 1e-4
    assert a.generate("abc", 8, temperature=0).token_ids == b.generate("abc", 8, temperature=0).token_ids


def test_timings_split_reused_prompt_tokens_from_read_ones_as_llama_server():
    llm = kvslim.load(ctx=256, prefix_cache=True)
    ids = llm.tokenize("It is a truth universally acknowledged, that a single man")
    first = llm.generate(ids, 4, temperature=0)
    again = llm.generate(ids + first.token_ids + llm.tokenize(" in possession", add_special=False), 4, temperature=0)
    t = again.timings
    assert first.timings["cache_n"] == 0 and first.timings["prompt_n"] == len(ids)
    assert t["cache_n"] >= len(ids) and t["cache_n"] + t["prompt_n"] == again.prompt_tokens
    assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / (t["prompt_ms"] / 1000))   # the rate of what was read
