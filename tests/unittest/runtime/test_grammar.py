"""Structured output in the runtime (runtime/grammar.py): the bitmask applied to logits (torch reference, random
logits, poisoned disallowed tokens never chosen), masks of verify rows after drafts (matcher rolled back), the
compile cache and its errors, stop ids under a grammar, and the `small` preset generating under JSON schemas,
regexes and grammars: output valid, greedy output identical with MTP and n-gram speculation, sampled output
valid, an unfinishable grammar ending at ``max_tokens``, grammar requests launched ahead by the overlap scheduler
(tokens chosen one step late) giving the eager run's tokens, also when they end or are aborted with a step in flight."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from trtllm_glm import LLM, MTPDecodingConfig, NGramDecodingConfig  # noqa: E402
from trtllm_glm.runtime import grammar  # noqa: E402
from trtllm_glm.runtime.grammar import (  # noqa: E402
    GrammarCompiler,
    GuidedDecodingParams,
    allowed_tokens,
    apply_token_bitmask,
    bitmask_words,
    fill_bitmasks,
)
from trtllm_glm.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from trtllm_glm.runtime.tokenizer import ByteTokenizer  # noqa: E402

pytestmark = pytest.mark.cpu_only

V = 264  # the small preset's byte vocabulary: 256 bytes, BOS 256, EOS 257, PAD 258, 5 spare ids
EOS = 257
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                "minimum": 0, "maximum": 8}}, "required": ["kind", "legs"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "pet"],
    "additionalProperties": False,
}  # fmt: skip


def _nested(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(V, 256, EOS, 258), V, [EOS])


def _bits(rows: list[list[int]], vocab: int) -> torch.Tensor:
    bm = torch.zeros(len(rows), bitmask_words(vocab), dtype=torch.int32)
    for r, ids in enumerate(rows):
        for t in ids:
            bm[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return bm


def test_apply_bitmask_reference_on_random_logits() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=g)
    allowed = [torch.randperm(vocab, generator=g)[:k].tolist() for k in (1, 2, 31, 500, vocab)]
    bm = _bits(allowed, vocab)
    assert [sorted(allowed_tokens(bm[r], vocab)) for r in range(5)] == [sorted(a) for a in allowed]
    out = apply_token_bitmask(logits.clone(), bm)
    for r, ids in enumerate(allowed):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[ids] = True
        assert torch.equal(out[r][keep], logits[r][keep])
        assert torch.isneginf(out[r][~keep]).all()
    with pytest.raises(ValueError, match="cannot cover"):
        apply_token_bitmask(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int32))


def test_poisoned_disallowed_tokens_are_never_chosen() -> None:
    """Disallowed tokens get the largest logits by far: greedy and sampled draws still pick allowed ones only."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 300, 64
    logits = torch.randn(n, vocab, generator=g)
    allowed = [torch.randperm(vocab, generator=g)[: 1 + r % 7].tolist() for r in range(n)]
    for r, ids in enumerate(allowed):
        poison = torch.ones(vocab, dtype=torch.bool)
        poison[ids] = False
        logits[r, poison] += 1e4
    masked = apply_token_bitmask(logits.clone(), _bits(allowed, vocab))
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.5, top_k=0 if r % 3 else 5, seed=r) for r in range(n)]
    for _ in range(10):
        toks = Sampler().sample(masked, params, [torch.Generator().manual_seed(r) for r in range(n)]).tolist()
        assert all(t in ids for t, ids in zip(toks, allowed))


@pytest.mark.parametrize("serial", [True, False], ids=["this-thread", "llguidance-pool"])
def test_verify_row_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(serial, monkeypatch) -> None:
    monkeypatch.setattr(grammar, "SERIAL_MAX", 100 if serial else 0)
    comp = _compiler()
    g = comp.matcher(GuidedDecodingParams(json=SCHEMA), [EOS])
    prefix = list(b'{"name": "ab", "age": 4')
    for t in prefix:
        assert g.accept(t)
    drafts = list(b'2, "color"')
    before = fill_bitmasks([(g, 0, [])], 1, V)
    bm = fill_bitmasks([(g, 1, drafts)], 2 + len(drafts), V)
    assert torch.equal(bm[1], before[0]) and allowed_tokens(bm[0], V) == list(range(V))  # row 0: not named
    # Row 1 + j: the state after drafts[:j], as consuming them one by one gives.
    ref = comp.matcher(GuidedDecodingParams(json=SCHEMA), [EOS])
    for t in prefix:
        ref.accept(t)
    for j, t in enumerate(drafts):
        ref.accept(t)
        assert torch.equal(bm[2 + j], fill_bitmasks([(ref, 0, [])], 1, V)[0]), j
    # Nothing was consumed: the state is still after the prefix.
    assert g.num_consumed == len(prefix) and torch.equal(fill_bitmasks([(g, 0, [])], 1, V)[0], before[0])
    # A refused draft: the rows before it are exact (the refused one is excluded from its own row).
    bm = fill_bitmasks([(g, 0, [ord("7"), ord("x"), ord("1")])], 4, V)
    assert ord("x") not in allowed_tokens(bm[1], V) and ord("7") in allowed_tokens(bm[0], V)
    # ... and the refused draft left the matcher usable, where it was.
    assert not g.matcher.is_error() and torch.equal(fill_bitmasks([(g, 0, [])], 1, V)[0], before[0])
    assert g.accept(ord("2")) and g.failed is None


def test_eos_only_where_the_grammar_accepts_and_stop_ids_in_its_place() -> None:
    comp = _compiler()
    p = GuidedDecodingParams(regex=r"ab+")
    for stop_ids, want in (([EOS], [EOS]), ([5, EOS], [5, EOS]), ([300 % V], [300 % V]), ([], [])):
        g = comp.matcher(p, stop_ids)
        assert allowed_tokens(fill_bitmasks([(g, 0, [])], 1, V)[0], V) == [ord("a")]
        g.accept(ord("a"))
        g.accept(ord("b"))
        # Accepting: the request's own stop ids in place of EOS (ignore_eos: none; "b" until max_tokens) or "b".
        assert allowed_tokens(fill_bitmasks([(g, 0, [])], 1, V)[0], V) == sorted({ord("b"), *want}), stop_ids


def test_compile_once_per_distinct_grammar_and_errors_name_the_problem() -> None:
    comp = _compiler()
    comp.compile(GuidedDecodingParams(json=SCHEMA))
    comp.compile(GuidedDecodingParams(json=json.dumps(SCHEMA)))  # the same schema as text
    comp.matcher(GuidedDecodingParams(json=dict(SCHEMA)), [EOS])
    assert comp.num_compiles == 1
    for params, match in (
        (GuidedDecodingParams(json={"type": "objectx"}), "invalid JSON schema.*objectx"),
        (GuidedDecodingParams(regex="[a-"), "invalid regex"),
        (GuidedDecodingParams(grammar="start: nope"), "invalid grammar"),
        (GuidedDecodingParams(json="false"), "matches no output"),
        (GuidedDecodingParams(json=_nested(990)), "nested too deeply"),  # (Python's own recursion limit)
    ):
        with pytest.raises(ValueError, match=match):
            comp.compile(params)
    for kw, match in (
        ({}, "exactly one"), (dict(regex="a", json_object=True), "exactly one"), (dict(json="{"), "not valid JSON"),
        (dict(json="[1]"), "is an object"), (dict(regex=""), "non-empty"), (dict(json_object=1), "bool"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            GuidedDecodingParams(**kw)
    with pytest.raises(ValueError, match="GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": {}})  # type: ignore[arg-type]


def _valid(v: object, s: dict) -> bool:
    """A small JSON-schema check (the keywords these tests use)."""
    if "enum" in s and v not in s["enum"]:
        return False
    t = s.get("type")
    if t == "object":
        props = s.get("properties", {})
        return (isinstance(v, dict) and all(k in v for k in s.get("required", ()))
                and (s.get("additionalProperties", True) or set(v) <= set(props))
                and all(_valid(x, props[k]) for k, x in v.items() if k in props))  # fmt: skip
    if t == "array":
        return isinstance(v, list) and len(v) <= s.get("maxItems", 1 << 30) and all(_valid(x, s["items"]) for x in v)
    if t == "string":
        return isinstance(v, str) and len(v) <= s.get("maxLength", 1 << 30)
    if t == "integer":
        return isinstance(v, int) and s.get("minimum", -(1 << 62)) <= v <= s.get("maximum", 1 << 62)
    return True


@pytest.fixture(scope="module")
def llms() -> dict[str, LLM]:
    kw = dict(device="cpu", max_batch_size=4, max_seq_len=512)
    return {
        "plain": LLM("small", **kw),
        "mtp": LLM("small", speculative_config=MTPDecodingConfig(num_nextn_predict_layers=3), **kw),
        "ngram": LLM("small", speculative_config=NGramDecodingConfig(max_draft_len=4), **kw),
    }


PROMPTS = ["<|user|>\nA person as JSON\n<|assistant|>\n", "def main():", '{"name": "Ann", "age": 41, ']


def test_greedy_output_valid_and_identical_with_speculation(llms) -> None:
    cases = [
        (GuidedDecodingParams(json=SCHEMA), lambda t: _valid(json.loads(t), SCHEMA)),
        (GuidedDecodingParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (GuidedDecodingParams(regex=r"(ab|cd){1,4} [0-9]{3}"), lambda t: t[-4] == " " and t[-3:].isdigit()),
        (GuidedDecodingParams(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'), lambda t: t.startswith("x=")),
    ]
    got: dict[str, list] = {}
    for name, llm in llms.items():
        outs = []
        for g, ok in cases:
            for o in llm.generate(PROMPTS, SamplingParams(max_tokens=160, guided_decoding=g)):
                c = o.outputs[0]
                assert c.finish_reason == "stop" and ok(c.text), (name, g.kind, c.text)
                outs.append(c.token_ids)
        got[name] = outs
    assert got["mtp"] == got["plain"] and got["ngram"] == got["plain"]
    # Speculation did run (drafts verified under the grammar, some accepted).
    o = llms["ngram"].generate(PROMPTS[0], SamplingParams(max_tokens=110, guided_decoding=cases[0][0])).outputs[0]
    assert o.num_draft_rounds > 0 and o.mean_accepted_length > 1.0


def test_sampled_output_valid_and_unfinishable_grammar_ends_at_max_tokens(llms) -> None:
    llm = llms["plain"]
    sp = SamplingParams(max_tokens=160, temperature=1.0, top_p=0.95, seed=3, guided_decoding=GuidedDecodingParams(
        json=SCHEMA))  # fmt: skip
    for o in llm.generate(PROMPTS, sp):
        assert o.outputs[0].finish_reason == "stop" and _valid(json.loads(o.outputs[0].text), SCHEMA)
    free = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    o = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, guided_decoding=free)).outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 12 and o.text.startswith('{"a": "')
    with pytest.raises(ValueError, match="guided_decoding: invalid JSON schema"):
        llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": 3})))


def test_grammar_requests_are_launched_ahead(llms) -> None:
    """The overlap scheduler launches a step with a grammar request ahead too: its tokens are chosen one step late
    (`Executor._choose_under_grammar`), so nothing waits for its mask."""
    ex = llms["plain"].executor
    was, ex.cfg.overlap_scheduler = ex.cfg.overlap_scheduler, True  # (no graphs on the CPU: the decision only)
    try:
        plain = ex.add_request([1, 2, 3], SamplingParams(max_tokens=20))
        guided = ex.add_request([1, 2, 3], SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(
            json_object=True)))  # fmt: skip
        ex.step()
        plan = ex._plan()
        assert all(s.is_decode for s in plan) and len(plan) == 2
        assert ex._may_launch_ahead(plan)
        ex.abort_request(guided.request_id)
        ex.abort_request(plain.request_id)
    finally:
        ex.cfg.overlap_scheduler = was


def _masks(g, drafts=()) -> list[list[int]]:
    bm = fill_bitmasks([(g, 0, list(drafts))], 1 + len(drafts), V)
    return [allowed_tokens(bm[i], V) for i in range(1 + len(drafts))]


@pytest.mark.parametrize("mode", ["inside", "optional"])
def test_grammar_after_thinking_masks_and_drafts(mode: str) -> None:
    """Thinking first: free text (no end of sequence) up to ``</think>``, then the grammar from its start; verify
    rows across the phase change equal the masks step by step, and the state is left as it was."""
    comp = _compiler()
    gp = GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                              reasoning=mode)  # fmt: skip
    out = ("\n<think>" if mode == "optional" else "") + 'I think {"a": 1} </thi </think>{"a": 12}'
    g = comp.matcher(gp, [EOS])
    if mode == "optional":  # the opening tag after whitespace, or the answer itself
        assert sorted(map(chr, _masks(g)[0])) == sorted(["\t", "\n", "\x0b", "\x0c", "\r", " ", "<", "{"])
    else:
        assert len(_masks(g)[0]) == V - 1 and EOS not in _masks(g)[0]
    toks = list(out.encode())
    step = []
    for t in toks:
        step.append(_masks(g)[0])
        assert t in step[-1], (chr(t), g.phase)
        assert g.accept(t)
    assert g.phase == "answer" and EOS in _masks(g)[0] and g.is_accepting
    # All at once as drafts: the same rows, and the matcher where it was.
    g2 = comp.matcher(gp, [EOS])
    assert _masks(g2, toks[:-1]) == step and g2.phase == ("start" if mode == "optional" else "think")
    assert g2.valid_prefix(toks) == len(toks) and g2.valid_prefix(toks[:-3] + [ord("x")]) == len(toks) - 3
    # A capped thinking: past the cap only the closing tag's bytes, in order.
    g3 = comp.matcher(GuidedDecodingParams(json_object=True, reasoning="inside", max_reasoning_tokens=2), [EOS])
    for t in b"ab</think":
        assert _masks(g3)[0] == ([t] if g3.num_reasoning_tokens >= 2 else _masks(g3)[0]) and g3.accept(t)
    assert _masks(g3)[0] == [ord(">")] and g3.accept(ord(">")) and _masks(g3)[0] == [ord("{")]
    with pytest.raises(ValueError, match="needs reasoning"):
        GuidedDecodingParams(json_object=True, max_reasoning_tokens=3)
    with pytest.raises(ValueError, match="reasoning must be"):
        GuidedDecodingParams(json_object=True, reasoning="yes")


def test_thinking_tokens_that_cross_the_closing_tag_are_excluded(monkeypatch) -> None:
    """A BPE vocabulary may hold tokens that close the thinking and start the answer in one (``>{``): those are
    excluded while thinking (the grammar would never see their answer bytes), a token that ends exactly at the tag
    (``</think>``, ``x</think>``) is allowed, and an opening token may carry thinking text (``<think>hi``)."""
    import llguidance as llg

    extra = [b">{", b"</think>", b"x</think>{", b"x</think>", b"<think>hi", b"<think></think>{"]
    n = 256 + len(extra) + 1
    eos = n - 1

    class _Tok:
        eos_token_id, bos_token_id = eos, None
        tokens = [bytes([i]) for i in range(256)] + extra + [b"<|eos|>"]
        special_token_ids = [eos]

        def __call__(self, s):  # noqa: ANN001, ANN204
            return list(s if isinstance(s, bytes) else s.encode())

    ll = llg.LLTokenizer(llg.TokenizerWrapper(_Tok()), n_vocab=n, eos_token=[eos])
    comp = GrammarCompiler(ByteTokenizer(264, 256, 257, 258), n, [eos])
    monkeypatch.setattr(comp, "_tok", lambda: ll)
    ids = {b: 256 + i for i, b in enumerate(extra)}

    def allowed(g) -> set[int]:  # noqa: ANN001
        return set(allowed_tokens(fill_bitmasks([(g, 0, [])], 1, n)[0], n))

    g = comp.matcher(GuidedDecodingParams(json_object=True, reasoning="inside"), [eos])
    a = allowed(g)
    assert ids[b"</think>"] in a and ids[b"x</think>"] in a and ids[b"x</think>{"] not in a and eos not in a
    for t in b"ok</think":
        g.accept(t)
    a = allowed(g)
    assert ord(">") in a and ids[b">{"] not in a
    g.accept(ord(">"))
    assert g.phase == "answer" and allowed(g) == {ord("{")}
    o = comp.matcher(GuidedDecodingParams(json_object=True, reasoning="optional"), [eos])
    a = allowed(o)
    assert ids[b"<think>hi"] in a and ids[b"<think></think>{"] not in a and ord("{") in a
    assert o.accept(ids[b"<think>hi"]) and o.phase == "think" and o.accept(ids[b"</think>"]) and o.phase == "answer"


def test_thinking_then_constrained_answer_identical_with_speculation(llms) -> None:
    """The Python API: a prompt that opens the thinking, a JSON schema after it (thinking capped at 8 tokens: the
    random weights never close it themselves); the thinking is free text, the answer validates, and greedy output
    is the same with MTP and n-gram speculation."""
    prompts = ["<|user|>\nA person as JSON\n<|assistant|><think>", "<|assistant|>\n<think>Plan: {"]
    sp = SamplingParams(max_tokens=200, guided_decoding=GuidedDecodingParams(json=SCHEMA, reasoning="inside",
                        max_reasoning_tokens=8))  # fmt: skip
    got = {}
    for name, llm in llms.items():
        outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
        for o in outs:
            thought, _, answer = o.text.partition("</think>")
            assert o.finish_reason == "stop" and _valid(json.loads(answer), SCHEMA), (name, o.text)
            assert not thought.startswith("{") and len(o.token_ids) > len(answer) + 8, (name, o.text)
        got[name] = [o.token_ids for o in outs]
    assert got["mtp"] == got["plain"] and got["ngram"] == got["plain"]


def test_ngram_drafts_cut_where_the_grammar_refuses(llms, monkeypatch) -> None:
    """n-gram drafts copied from text the schema forbids (``"age": forty``) are cut on the host before verify at the
    first token the grammar refuses: the same output, the same accepted drafts, far fewer proposed (acceptance
    rate up)."""
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer",
              "minimum": 0, "maximum": 120}, "color": {"enum": ["red", "green", "blue"]}},
              "required": ["name", "age", "color"], "additionalProperties": False}  # fmt: skip
    prompt = list(b'{"name": "Ann", "age": forty, "color": purple}\n{"name": "Bo", "age": many, "color": "pink"}\n')
    ex = llms["ngram"].executor

    def run() -> tuple[list[int], int, int]:
        r = ex.add_request(prompt, SamplingParams(max_tokens=80, guided_decoding=GuidedDecodingParams(json=schema)))
        ex.run_until_done()
        assert r.finish_reason.value == "stop" and _valid(json.loads(bytes(r.output_ids[:-1])), schema)
        return r.output_ids, sum(r.proposed_per_position), sum(r.accepted_per_position)

    cut_before = ex.num_drafts_cut_by_grammar
    out, proposed, accepted = run()
    assert ex.num_drafts_cut_by_grammar > cut_before
    monkeypatch.setattr(SpeculativeExecutor, "_cut_drafts_by_grammar", lambda self, plan, seqs: None)
    out_ref, proposed_ref, accepted_ref = run()
    assert out == out_ref and accepted == accepted_ref > 0
    assert proposed < proposed_ref and accepted / proposed > accepted_ref / proposed_ref


@pytest.mark.parametrize("mode", ["overlap", "ngram"])
def test_graphs_emulated_grammar_rows_match_eager(monkeypatch, mode: str) -> None:
    """With (emulated) CUDA graphs, the overlap scheduler and speculation, a batch mixing grammar and free requests,
    greedy and seeded sampled, gives the eager plain run's tokens. Under the overlap scheduler steps with grammar
    requests are launched ahead, their tokens chosen under the masks one step late (`_choose_under_grammar`, every
    row in one draw in row order); a verify step that checks a grammar request's drafts runs eagerly (a verify graph
    would accept them on the device, unmasked). (MTP's chained draft graphs pad their batch, which the CPU's torch
    k-pool ops cannot run: the GPU test covers it.)"""
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig
    from trtllm_glm.runtime.speculative_executor import SpeculativeExecutor

    model = Glm5NextForCausalLM.from_pretrained("small", device="cpu").eval()
    tok = ByteTokenizer(V, 256, EOS, 258)
    prompts = [list(p.encode()) for p in ("def f(x):\n    return", '{"name": "Bo", "age": 3', "import os\n", "x")]
    small = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0,
             "maximum": 99}, "t": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2}},
             "required": ["c", "n", "t"], "additionalProperties": False}  # fmt: skip
    guided = GuidedDecodingParams(json=small)
    # Free (even) and grammar (odd) requests, greedy (0, 1) and seeded sampled (2, 3).
    params = [SamplingParams(max_tokens=60 if i % 2 else 70, ignore_eos=not i % 2,
                             guided_decoding=guided if i % 2 else None,
                             **({"temperature": 0.8, "top_k": 20, "seed": 5 + i} if i >= 2 else {}))
              for i in range(len(prompts))]  # fmt: skip
    chosen_late: list[int] = []
    choose = Executor._choose_under_grammar

    def spy(self, plan, out):  # noqa: ANN001, ANN202
        chosen_late.append(sum(s.request.has_grammar for s in plan))
        return choose(self, plan, out)

    monkeypatch.setattr(Executor, "_choose_under_grammar", spy)

    def run(graphs: bool) -> list[list[int]]:
        # Every batch size captured exactly (no padding rows: the torch k-pool ops the CPU runs do not skip them).
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=8, max_num_tokens=256,
                             max_seq_len=128, overlap_scheduler=graphs,
                             cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 3, 4], enable_padding=False)
                             if graphs else None)  # fmt: skip
        if not graphs or mode == "overlap":
            ex = Executor(model, cfg)
        else:
            ex = SpeculativeExecutor(model, cfg, NGramDecodingConfig(max_draft_len=3))
        ex.grammar_compiler = GrammarCompiler(tok, V, [EOS])
        reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
        ex.run_until_done()
        if graphs:
            assert ex.graph_runner is not None and ex.graph_runner.stats.replays > 0
            if mode == "overlap":  # grammar requests' steps launched ahead, both of them in most
                assert ex.num_overlapped_steps > 20 and sum(n == 2 for n in chosen_late) > 15, chosen_late
            else:
                assert sum(r.num_accepted_total - r.num_verify_rounds for r in reqs if r.has_grammar) > 0
        return [r.output_ids for r in reqs]

    ref = run(False)
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    assert run(True) == ref
    assert _valid(json.loads(tok.decode(ref[1])), small)  # (the greedy one; the sampled one may run out of tokens)


def test_grammar_steps_in_flight_when_requests_end_or_are_aborted(monkeypatch) -> None:
    """The overlap scheduler with (emulated) graphs and grammar requests whose tokens are chosen one step late: a
    short regex ends its request (end of sequence forced by the grammar) while the step after it is in flight, and
    another grammar request is aborted with a step in flight; the other requests' tokens equal the eager run's, the
    ended request's output too, and everything is given back."""
    from trtllm_glm.models.glm5_next import Glm5NextForCausalLM
    from trtllm_glm.runtime.cuda_graph import CudaGraphConfig
    from trtllm_glm.runtime.executor import Executor, ExecutorConfig

    model = Glm5NextForCausalLM.from_pretrained("small", device="cpu").eval()
    tok = ByteTokenizer(V, 256, EOS, 258)
    prompts = [list(p.encode()) for p in ("def f(x):\n    return", "The answer is", "import os\n", "x = [1, 2")]
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}")),  # ends after 3
        SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{60}")),  # aborted
        SamplingParams(max_tokens=40, temperature=0.9, top_k=10, seed=11, ignore_eos=True),
    ]

    def run(graphs: bool, abort_at: int | None) -> tuple[list, Executor]:
        cfg = ExecutorConfig(tokens_per_block=16, max_tokens=4096, max_batch_size=8, max_num_tokens=256,
                             max_seq_len=128, overlap_scheduler=graphs,
                             cuda_graph_config=CudaGraphConfig(batch_sizes=[1, 2, 3, 4], enable_padding=False)
                             if graphs else None)  # fmt: skip
        ex = Executor(model, cfg)
        ex.grammar_compiler = GrammarCompiler(tok, V, [EOS])
        reqs = [ex.add_request(p, sp) for p, sp in zip(prompts, params)]
        finish = ex._finish

        def spy(r):  # noqa: ANN001, ANN202 - (request, a step of it still in flight when it ended)
            late.append((r, ex._inflight is not None and any(s.request is r for s in ex._inflight.plan)))
            finish(r)

        ex._finish = spy  # type: ignore[method-assign]
        steps, aborted = 0, False
        while ex.has_work:
            ex.step()
            steps += 1
            # Abort request 2 while a step of it is in flight (its token not chosen yet).
            flight = [] if ex._inflight is None else [s.request for s in ex._inflight.plan]
            if abort_at is not None and steps >= abort_at and not aborted and any(r is reqs[2] for r in flight):
                ex.abort_request(reqs[2].request_id)
                aborted = True
        assert aborted or abort_at is None
        assert ex.manager.num_free_pages == ex.manager.num_pages
        return reqs, ex

    late: list = []
    ref, _ = run(False, None)
    monkeypatch.setattr(Executor, "_graphs_supported", lambda self: True)
    late.clear()
    got, ex = run(True, 6)
    assert ex.num_overlapped_steps > 10
    assert any(r is got[1] and in_flight for r, in_flight in late), late  # the regex ended with its next step launched
    assert got[1].output_ids == ref[1].output_ids and tok.decode(got[1].output_ids)[:3].isdigit()
    assert got[1].finish_reason == ref[1].finish_reason
    for i in (0, 3):
        assert got[i].output_ids == ref[i].output_ids, i
    assert got[2].output_ids == ref[2].output_ids[: len(got[2].output_ids)] and len(got[2].output_ids) < 40
