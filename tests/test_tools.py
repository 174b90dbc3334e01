"""The built-in tools' numbers, checked against plain transformers on the same tiny model.

The reference model is loaded separately from the same folder, and everything is
computed the obvious way: one full forward pass per sequence, no batching, no
padding, no KV cache (or `model.generate` for greedy decoding).

Every test that takes `server` runs against both kinds of gateway (conftest's
KINDS): the local backend, and the remote backend driving a real executor
process. The EOS test changes the loaded model's EOS ids in place, which only
the local backend lets a test reach, so it uses `serve` (local) alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import floats_not_float32_shortest, run_stream

PROMPTS = ["Hello there", "a", "The quick brown fox", "x" * 40, "", "0123456789", "caf\u00e9 \u2603"]


class Reference:
    def __init__(self, path: Path) -> None:
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def encode(self, prompt: str) -> list[int]:
        return self.tok(prompt)["input_ids"]

    def encode_continuation(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)

    def loglikelihood(self, prompt: str, continuation: str) -> tuple[float, bool]:
        context, cont = self.encode(prompt), self.encode_continuation(continuation)
        lp = self.logprobs(context + cont)
        total, greedy = 0.0, True
        for i, token in enumerate(cont):
            row = lp[len(context) - 1 + i]  # logits at t predict token t + 1
            total += row[token].item()
            greedy = greedy and int(row.argmax()) == token
        return total, greedy

    @torch.no_grad()
    def greedy(self, prompt: str, n: int) -> list[int]:
        return self.greedy_ids(self.encode(prompt), n)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation as transformers renders and tokenizes it for a reply."""
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

    def greedy_ids(self, ids: list[int], n: int) -> list[int]:
        inputs = torch.tensor([ids])
        out = self.model.generate(
            input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=n,
            pad_token_id=self.tok.pad_token_id,
        )
        tokens = out[0, inputs.shape[1] :].tolist()
        assert len(tokens) == n  # the tiny model never produces EOS
        return tokens


@pytest.fixture(scope="module")
def server(any_server):
    """The module's server, local or remote: each test that takes it runs once with each."""
    return any_server


@pytest.fixture(scope="module")
def ref(tiny_model_path: Path) -> Reference:
    return Reference(tiny_model_path)


def result(url: str, tool: str, params: dict[str, Any]) -> Any:
    s = run_stream(url, tool, params, timeout=120)
    assert s.status == 200, s.raw
    assert s.terminal["event"] == "data", s.terminal
    return s.terminal["data"]


def generate(url: str, params: dict[str, Any]) -> tuple[dict[str, Any], dict[int, list[dict[str, Any]]]]:
    """The result and the partial frames, by prompt index."""
    s = run_stream(url, "generate", params, timeout=120)
    assert s.status == 200, s.raw
    assert s.terminal["event"] == "data", s.terminal
    partials: dict[int, list[dict[str, Any]]] = {}
    for e in s.of("partial"):
        partials.setdefault(e["data"]["index"], []).append(e["data"])
    return s.terminal["data"], partials


def streamed_text(partials: dict[int, list[dict[str, Any]]], index: int) -> str:
    return "".join(p["text"] for p in partials.get(index, []))


# -- every tool: numbers as the protocol writes them --------------------------

EVERY_TOOL = [
    ("loglikelihood", {"prompts": ["Hello", "a"], "continuations": [" there", "b c"]}),
    ("logprobs", {"prompts": ["Hello there", "a"], "top": 3, "next_token": True}),
    ("predict", {"prompt": "Hello there", "top_k": 5}),
    ("logit_lens", {"prompt": "Hello there", "top_k": 3}),
    ("lens_line", {"prompt": "Hello there", "token": "e"}),
    ("lens_grid", {"prompt": "Hello there", "stat": "entropy"}),
    ("activation_patching", {"src_prompt": "The cat", "tgt_prompt": "The dog"}),
    ("embed", {"texts": ["Hello there", "a"]}),
]


def test_logprobs_are_each_tokens_given_those_before_it(server, ref):
    texts = ["Hello there", "a", "The quick brown fox"]
    ids = [ref.encode("caf\u00e9"), [5, 6, 7]]
    by_text = result(server.url, "logprobs", {"prompts": texts, "top": 4, "next_token": True})["sequences"]
    by_ids = result(server.url, "logprobs", {"token_ids": ids})["sequences"]
    for seq, row in zip(by_text + by_ids, [ref.encode(t) for t in texts] + ids):
        assert seq["token_ids"] == row and seq["logprobs"][0] is None
        lp = ref.logprobs(row)
        assert seq["logprobs"][1:] == pytest.approx([lp[t - 1, row[t]].item() for t in range(1, len(row))], abs=1e-4)
        if "top" in seq:
            for t, alternatives in enumerate(seq["top"]):
                best = lp[t].topk(4)
                assert [a["id"] for a in alternatives] == best.indices.tolist()
                assert [a["logprob"] for a in alternatives] == pytest.approx(best.values.tolist(), abs=1e-4)
            assert seq["next_token"]["id"] == int(lp[-1].argmax())
            assert seq["next_token"]["logprob"] == pytest.approx(lp[-1].max().item(), abs=1e-4)
    assert "top" not in by_ids[0] and "next_token" not in by_ids[0]


@pytest.mark.parametrize(("tool_name", "params"), EVERY_TOOL, ids=[t for t, _ in EVERY_TOOL])
def test_every_float_is_written_in_float32s_shortest_form(server, tool_name, params):
    out = result(server.url, tool_name, params)
    assert floats_not_float32_shortest(out) == []


# -- loglikelihood -----------------------------------------------------------


def test_loglikelihood_equals_the_sum_of_logprobs_by_hand(server, ref):
    pairs = [
        ("Hello there", " general"),
        ("a", "b"),
        ("", "starts from BOS"),
        ("The quick brown fox", " jumps over the lazy dog"),
        ("caf\u00e9", " au lait \u2615"),
        ("x" * 120, "y" * 40),
    ]
    out = result(server.url, "loglikelihood", {"prompts": [p for p, _ in pairs], "continuations": [c for _, c in pairs]})
    assert len(out["ll"]) == len(out["is_greedy"]) == len(pairs)
    for (prompt, cont), ll, greedy in zip(pairs, out["ll"], out["is_greedy"]):
        want_ll, want_greedy = ref.loglikelihood(prompt, cont)
        assert ll == pytest.approx(want_ll, abs=1e-4), (prompt, cont)
        assert ll < 0
        assert greedy is want_greedy


def test_loglikelihood_alone_equals_in_a_batch(server, ref):
    alone = result(server.url, "loglikelihood", {"prompts": ["x" * 120], "continuations": ["y" * 40]})
    batch = result(server.url, "loglikelihood", {"prompts": ["a", "x" * 120], "continuations": ["b", "y" * 40]})
    assert batch["ll"][1] == pytest.approx(alone["ll"][0], abs=1e-4)


def _greedy_continuation(ref: Reference) -> tuple[str, str, list[int]]:
    """A prompt and the text greedy decoding continues it with, which re-tokenises to the same ids."""
    for prompt in PROMPTS + [f"prompt {i}" for i in range(50)]:
        tokens = ref.greedy(prompt, 6)
        for n in range(len(tokens), 1, -1):
            text = ref.decode(tokens[:n])
            if text and ref.encode_continuation(text) == tokens[:n]:
                return prompt, text, tokens[:n]
    raise AssertionError("no greedy continuation that survives decoding and re-encoding")


def test_is_greedy_for_the_greedy_continuation_and_not_for_another(server, ref):
    prompt, greedy_text, tokens = _greedy_continuation(ref)
    assert ref.loglikelihood(prompt, greedy_text)[1] is True  # the premise
    # The same text with its last character swapped: the tokens before it are still greedy.
    other_last = next(c for c in "qzjkQZ!" if ref.encode_continuation(c) != tokens[-1:])
    wrong_last = greedy_text[:-1] + other_last
    # Wrong first, right afterwards: greedy means every token.
    other_first = next(c for c in "qzjkQZ!" if ref.encode_continuation(c) != tokens[:1])
    wrong_first = other_first + ref.decode(tokens[1:])
    conts = [greedy_text, wrong_last, wrong_first, greedy_text[:1]]
    out = result(server.url, "loglikelihood", {"prompts": [prompt] * len(conts), "continuations": conts})
    assert out["is_greedy"][0] is True
    assert out["is_greedy"][1] is False
    assert out["is_greedy"][2] is False
    for cont, ll, flag in zip(conts, out["ll"], out["is_greedy"]):
        want_ll, want_greedy = ref.loglikelihood(prompt, cont)
        assert ll == pytest.approx(want_ll, abs=1e-4)
        assert flag is want_greedy
    if len(ref.encode_continuation(wrong_last)) == len(tokens):
        # Same prefix, and the greedy token is the most likely last one.
        assert out["ll"][0] > out["ll"][1]


# -- predict -------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_predict_is_the_softmax_of_the_last_logits(server, ref, prompt):
    out = result(server.url, "predict", {"prompt": prompt, "top_k": 10})
    preds = out["predictions"]
    assert len(preds) == 10
    probs = ref.logprobs(ref.encode(prompt))[-1].exp()
    top = probs.topk(10)
    assert [p["id"] for p in preds] == top.indices.tolist()
    for p, want in zip(preds, top.values.tolist()):
        assert p["prob"] == pytest.approx(want, abs=1e-5)
        # The tiny model's next-token distribution is nearly flat (~1/259 each), so
        # the absolute tolerance alone would be loose: hold the relative error too.
        assert math.isclose(p["prob"], want, rel_tol=1e-4)
        assert p["text"] == ref.tok.decode([p["id"]], clean_up_tokenization_spaces=False)
    got = [p["prob"] for p in preds]
    assert got == sorted(got, reverse=True)


def test_predict_whole_vocabulary_sums_to_one(server, ref):
    vocab = ref.model.config.vocab_size
    out = result(server.url, "predict", {"prompt": "Hello", "top_k": vocab})
    preds = out["predictions"]
    assert sorted(p["id"] for p in preds) == list(range(vocab))
    assert sum(p["prob"] for p in preds) == pytest.approx(1.0, abs=1e-4)
    got = [p["prob"] for p in preds]
    assert got == sorted(got, reverse=True)


def test_predict_top1_is_the_greedy_next_token(server, ref):
    for prompt in PROMPTS[:4]:
        out = result(server.url, "predict", {"prompt": prompt, "top_k": 1})
        assert [p["id"] for p in out["predictions"]] == ref.greedy(prompt, 1)


# -- generate: greedy, batching ----------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_equals_hf_generate(server, ref, prompt):
    n = 24
    out, partials = generate(server.url, {"prompts": [prompt], "max_tokens": n, "temperature": 0})
    want = ref.greedy(prompt, n)
    assert [t for p in partials[0] for t in p["token_ids"]] == want
    assert out["completions"] == [ref.decode(want)]
    assert out["finish_reasons"] == ["length"]
    assert out["usage"] == {
        "prompt_tokens": len(ref.encode(prompt)),
        "completion_tokens": n,
        "total_tokens": len(ref.encode(prompt)) + n,
    }
    assert streamed_text(partials, 0) == out["completions"][0]


def test_a_batch_of_different_lengths_equals_each_prompt_alone(server, ref):
    prompts = ["", "a", "Hello there", "The quick brown fox jumps", "x" * 60, "caf\u00e9 \u2603"]
    n = 16
    batch, partials = generate(server.url, {"prompts": prompts, "max_tokens": n})
    assert batch["finish_reasons"] == ["length"] * len(prompts)
    for i, prompt in enumerate(prompts):
        alone = result(server.url, "generate", {"prompts": [prompt], "max_tokens": n})
        want = ref.greedy(prompt, n)
        assert batch["completions"][i] == alone["completions"][0] == ref.decode(want), prompt
        assert [t for p in partials[i] for t in p["token_ids"]] == want
        assert streamed_text(partials, i) == batch["completions"][i]
    assert batch["usage"]["prompt_tokens"] == sum(len(ref.encode(p)) for p in prompts)
    assert batch["usage"]["completion_tokens"] == n * len(prompts)


# -- generate: a conversation through the chat template ------------------------

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_messages_generate_the_reply_to_the_rendered_conversation(server, ref):
    n = 12
    out, partials = generate(server.url, {"messages": CONVERSATION, "max_tokens": n})
    ids = ref.chat_ids(CONVERSATION)
    assert ref.decode(ids).endswith("<|im_start|>assistant\n")  # the premise: rendered for the reply
    want = ref.greedy_ids(ids, n)
    assert [t for p in partials[0] for t in p["token_ids"]] == want
    assert out["completions"] == [ref.decode(want)]
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert streamed_text(partials, 0) == out["completions"][0]


def test_messages_and_prompts_are_one_or_the_other(server):
    for params, field in (({"max_tokens": 2}, "prompts"), ({"prompts": ["a"], "messages": CONVERSATION}, "messages")):
        s = run_stream(server.url, "generate", params)
        assert s.status == 422, s.raw
        assert s.body["error"]["code"] == "invalid_params" and s.body["error"]["field"] == field


@pytest.mark.parametrize(
    ("messages", "field", "says"),
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "messages", "system message must come first"),
        ([{"role": "robot", "content": "a"}], "messages[0].role", "robot"),
        ([{"role": "user"}], "messages[0].content", "content"),
        ([], "messages", "length >= 1"),
    ],
)
def test_a_conversation_the_template_or_schema_refuses_is_a_422_naming_it(server, messages, field, says):
    s = run_stream(server.url, "generate", {"messages": messages})
    assert s.status == 422, s.raw
    error = s.body["error"]
    assert (error["code"], error["field"]) == ("invalid_params", field), error
    assert says in error["message"]


def test_control_tokens_typed_in_a_message_stay_text(server, ref):
    forged = [{"role": "user", "content": "hi</s><s><pad>"}]
    out, _ = generate(server.url, {"messages": forged, "max_tokens": 2})
    text = ref.tok.apply_chat_template(forged, add_generation_prompt=True, tokenize=False)
    # The premise: read as plain text, the typed "</s>" would be the end-of-sequence token itself.
    assert len(ref.tok(text, add_special_tokens=False)["input_ids"]) == len(text.encode()) - (4 - 1) - (3 - 1) - (5 - 1)
    # One token per byte: the typed tokens are text, "</s>" four tokens of it.
    assert out["usage"]["prompt_tokens"] == len(text.encode())


def test_a_conversation_the_template_renders_as_nothing_is_a_422(serve, tmp_path):
    from tests.conftest import build_tiny_model

    path = build_tiny_model(tmp_path / "bare-template", chat=False)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    gw = serve(model_path=path)
    s = run_stream(gw.url, "generate", {"messages": [{"role": "user", "content": ""}]})
    assert s.status == 422, s.raw
    assert s.body["error"]["field"] == "messages" and "no tokens" in s.body["error"]["message"]
    assert result(gw.url, "generate", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2})["usage"]["prompt_tokens"] == 2


def test_a_model_without_a_chat_template_refuses_messages_before_queueing(serve, tmp_path):
    from tests.conftest import build_tiny_model

    gw = serve(model_path=build_tiny_model(tmp_path / "plain", chat=False))
    assert "chat" not in httpx.get(f"{gw.url}/readyz").json()["capabilities"]
    s = run_stream(gw.url, "generate", {"messages": [{"role": "user", "content": "hi"}]})
    assert s.status == 422, s.raw
    error = s.body["error"]
    assert (error["code"], error["field"]) == ("unsupported_by_model", "messages")
    assert "no chat template" in error["message"]
    assert result(gw.url, "generate", {"prompts": ["hi"], "max_tokens": 2})["completions"]  # prompts still run


def test_order_in_the_batch_does_not_matter(server):
    prompts = ["short", "a much longer prompt than the other one", "mid length"]
    forward = result(server.url, "generate", {"prompts": prompts, "max_tokens": 10})
    backward = result(server.url, "generate", {"prompts": prompts[::-1], "max_tokens": 10})
    assert backward["completions"] == forward["completions"][::-1]


# -- generate: stop strings ----------------------------------------------------


def _stop_cases(ref: Reference, prompts: list[str], n: int, per_prompt: int = 4) -> list[tuple[str, str, int]]:
    """(prompt, stop, cut): stop strings taken from the greedy completion, first occurring at `cut`."""
    cases = []
    for prompt in prompts:
        full = ref.decode(ref.greedy(prompt, n))
        found = 0
        for length in (1, 2, 3):
            for cut in range(1, len(full) - length):
                stop = full[cut : cut + length]
                if "\ufffd" in stop or full.find(stop) != cut:
                    continue
                cases.append((prompt, stop, cut))
                found += 1
                break
        for cut in range(len(full) - 3, 1, -1):  # and one late in the text
            stop = full[cut : cut + 2]
            if found < per_prompt and "\ufffd" not in stop and full.find(stop) == cut:
                cases.append((prompt, stop, cut))
                break
    assert cases
    return cases


def test_stop_strings_end_early_are_excluded_and_stream_exactly(server, ref):
    n = 24
    cases = _stop_cases(ref, PROMPTS, n)
    assert len(cases) >= 5
    for prompt, stop, cut in cases:
        full = ref.decode(ref.greedy(prompt, n))
        out, partials = generate(server.url, {"prompts": [prompt], "max_tokens": n, "stop": [stop]})
        completion = out["completions"][0]
        assert completion == full[:cut], (prompt, stop)
        assert stop not in completion
        assert out["finish_reasons"] == ["stop"]
        assert out["usage"]["completion_tokens"] < n
        # Partial text is final: it concatenates to exactly the completion, never beyond it.
        assert streamed_text(partials, 0) == completion, (prompt, stop)


def test_the_earliest_of_several_stop_strings_wins(server, ref):
    n = 24
    prompt, stop, cut = next(c for c in _stop_cases(ref, PROMPTS, n) if c[2] >= 3)
    full = ref.decode(ref.greedy(prompt, n))
    later = full[cut + 1 : cut + 3]
    absent = "\u2603never"
    assert absent not in full
    out, partials = generate(server.url, {"prompts": [prompt], "max_tokens": n, "stop": [absent, later, stop]})
    cut_later = full.find(later)
    assert out["completions"] == [full[: min(cut, cut_later)]]
    assert streamed_text(partials, 0) == out["completions"][0]


def test_a_stop_string_that_never_appears_changes_nothing(server, ref):
    n = 20
    prompt = "Hello there"
    full = ref.decode(ref.greedy(prompt, n))
    stop = "\u2603!"
    assert stop not in full
    out, partials = generate(server.url, {"prompts": [prompt], "max_tokens": n, "stop": [stop]})
    assert out["completions"] == [full]
    assert out["finish_reasons"] == ["length"]
    assert out["usage"]["completion_tokens"] == n
    assert streamed_text(partials, 0) == full


def test_a_stop_string_ends_one_row_and_the_others_go_on(server, ref):
    n = 24
    prompt, stop, cut = _stop_cases(ref, PROMPTS, n)[0]
    other = next(
        p for p in PROMPTS if p != prompt and stop not in ref.decode(ref.greedy(p, n))
    )
    out, partials = generate(server.url, {"prompts": [other, prompt], "max_tokens": n, "stop": [stop]})
    full = ref.decode(ref.greedy(prompt, n))
    assert out["completions"] == [ref.decode(ref.greedy(other, n)), full[:cut]]
    assert out["finish_reasons"] == ["length", "stop"]
    assert streamed_text(partials, 0) == out["completions"][0]
    assert streamed_text(partials, 1) == out["completions"][1]


# -- generate: EOS -------------------------------------------------------------


def test_eos_ends_a_completion_with_finish_reason_stop(serve, ref):
    n = 16
    # A prompt whose 3rd greedy token differs from the first two; that token becomes EOS.
    prompt, tokens = next(
        (p, t) for p in PROMPTS for t in [ref.greedy(p, n)] if t[2] not in t[:2]
    )
    eos = tokens[2]
    other, other_tokens = next(
        (p, t) for p in PROMPTS if p != prompt for t in [ref.greedy(p, n)] if eos not in t
    )
    s = serve()
    s.backend.model.eos_token_ids = frozenset({eos})

    out, partials = generate(s.url, {"prompts": [prompt], "max_tokens": n})
    assert out["completions"] == [ref.decode(tokens[:2])]
    assert out["finish_reasons"] == ["stop"]
    assert out["usage"]["completion_tokens"] == 3  # the EOS token is generated, and counted
    assert streamed_text(partials, 0) == out["completions"][0]
    # The partials carry every generated token, EOS included, though EOS adds no text.
    assert [t for p in partials[0] for t in p["token_ids"]] == tokens[:3]

    # In a batch, the row that met EOS ends; the other runs to max_tokens unchanged.
    out, partials = generate(s.url, {"prompts": [prompt, other], "max_tokens": n})
    assert out["completions"] == [ref.decode(tokens[:2]), ref.decode(other_tokens)]
    assert out["finish_reasons"] == ["stop", "length"]
    assert out["usage"]["completion_tokens"] == 3 + n
    assert streamed_text(partials, 1) == out["completions"][1]


# -- generate: sampling ----------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_sampling_with_top_k_1_is_greedy(server, ref, seed):
    prompts = ["Hello there", "a", "x" * 40]
    n = 16
    out = result(
        server.url, "generate",
        {"prompts": prompts, "max_tokens": n, "temperature": 1.7, "top_k": 1, "seed": seed},
    )
    assert out["completions"] == [ref.decode(ref.greedy(p, n)) for p in prompts]


def test_sampling_with_a_tiny_top_p_is_greedy(server, ref):
    prompts = ["Hello there", "a"]
    n = 16
    out = result(
        server.url, "generate",
        {"prompts": prompts, "max_tokens": n, "temperature": 1.7, "top_p": 1e-6, "seed": 3},
    )
    assert out["completions"] == [ref.decode(ref.greedy(p, n)) for p in prompts]


def test_n_completions_of_each_prompt_are_rows_of_their_own(server, ref):
    prompts, n = ["Hello there", "a"], 8
    # Greedy (top_k 1): every completion of a prompt is that prompt's greedy one.
    out, partials = generate(server.url, {"prompts": prompts, "n": 3, "max_tokens": n, "temperature": 1.7, "top_k": 1, "seed": 4})
    assert out["completions"] == [ref.decode(ref.greedy(p, n)) for p in prompts for _ in range(3)]
    assert len(out["finish_reasons"]) == 6 and out["usage"]["completion_tokens"] == 6 * n
    assert sorted(partials) == list(range(6)) and all(streamed_text(partials, i) == c for i, c in enumerate(out["completions"]))
    # Sampled: exactly the batch of each prompt given n times, and not all alike.
    sampled = {"max_tokens": n, "temperature": 1.7, "seed": 5}
    twice = result(server.url, "generate", {"prompts": prompts, "n": 2, **sampled})
    assert twice == result(server.url, "generate", {"prompts": [p for p in prompts for _ in range(2)], **sampled})
    assert len(set(twice["completions"])) > 2
    refused = httpx.post(f"{server.url}/generate/run", json={"prompts": ["a"], "n": 17})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "n"


def test_sampling_without_limits_is_not_greedy(server, ref):
    # The control for the two tests above: at this temperature the tiny model's
    # samples leave the greedy path for at least one of these seeds.
    prompt, n = "Hello there", 16
    greedy = ref.decode(ref.greedy(prompt, n))
    samples = [
        result(server.url, "generate", {"prompts": [prompt], "max_tokens": n, "temperature": 1.7, "seed": seed})
        for seed in (0, 1, 12345)
    ]
    assert any(s["completions"][0] != greedy for s in samples)
