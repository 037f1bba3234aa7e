"""Black-box agents with images through the gateway: a tiny random Qwen2.5-VL (written locally, no download) on
the CPU engine behind the gateway; agents send OpenAI `image_url` parts (chat, plain and streamed) and Responses
`input_image` parts (with previous_response_id) over several turns and a branch. The trained ids are exactly the
ids the gateway sent and the engine returned, the trained pixel arrays exactly those it was given (the
processor's pixels of the agent's images, in order), and the trainer's logprobs equal the engine's. A text model,
an http(s) URL or a missing file is one 400 line naming the field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from test_gateway import FakeClient, Served, _post

from arbor.config.model import ModelConfig
from arbor.config.orchestrator import GatewayConfig
from arbor.inference.engine.core import Engine
from arbor.inference.server import BackgroundServer
from arbor.models import build_model, vision
from arbor.models.tokenizer import ByteTokenizer, load_tokenizer
from arbor.models.vision import VisionProcessor, data_url
from arbor.models.vision_tiny import write_tiny_vl
from arbor.orchestrator.batcher import build_step_batches
from arbor.orchestrator.client import InferenceClient
from arbor.orchestrator.gateway.service import Gateway, image_dirs
from arbor.trainer.step import micro_batch_logprobs


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return str(write_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl"))


class Recording:
    """The inference client, keeping every call's prompt ids, images and returned completions."""

    def __init__(self, client: InferenceClient) -> None:
        self.client, self.calls = client, []

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=None, images=None):
        out = await self.client.generate(
            prompt_ids, n, max_tokens, temperature, top_p, seed=seed, stop=stop, images=images
        )
        self.calls.append((list(prompt_ids), images, out))
        return out


def _image(url: str, kind: str = "image_url") -> dict[str, Any]:
    return {"type": kind, "image_url": url if kind == "input_image" else {"url": url}}


def _text(text: str, kind: str = "text") -> dict[str, Any]:
    return {"type": kind, "text": text}


async def _chat_agent(oa, a: str, b: str) -> None:
    """Three chat turns with an image in two of them (the second streamed), then a branch that drops the first
    exchange (a context edit: a new root holding image b only)."""
    msgs = [{"role": "system", "content": "look"}, {"role": "user", "content": [_text("what is it?"), _image(a)]}]
    r = await oa.chat.completions.create(model="m", messages=msgs, seed=1)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
    msgs += [{"role": "user", "content": [_image(b), _text("and this?")]}]
    stream = await oa.chat.completions.create(model="m", messages=msgs, seed=2, stream=True)
    reply = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "which came first?"}]
    await oa.chat.completions.create(model="m", messages=msgs, seed=3)
    await oa.chat.completions.create(model="m", messages=[msgs[0], *msgs[3:]], seed=4)


async def _responses_agent(oa, a: str, b: str) -> None:
    """Responses API: an input_image turn, then a streamed turn continuing it by previous_response_id."""
    first = await oa.responses.create(
        model="m", input=[{"role": "user", "content": [_image(a, "input_image"), _text("name it", "input_text")]}]
    )
    stream = await oa.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"role": "user", "content": [_text("and", "input_text"), _image(b, "input_image")]}],
        stream=True,
    )
    assert [e.type async for e in stream][-1] in ("response.completed", "response.incomplete")


def _serve(vl_dir: str, tmp: Path):
    """Runs both agents against the gateway in front of the engine; (sessions' rollouts, backend calls, urls)."""
    red, blue = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (48, 32), "blue")
    blue.save(tmp / "blue.png")
    a, b = data_url(red), str(tmp / "blue.png")  # a data URL and a local path
    tok = load_tokenizer(vl_dir)
    model = build_model(ModelConfig(name=vl_dir, impl="transformers"))
    engine = Engine(model, tok, seq_len=256, max_batch_size=4, seed=0).start()

    async def main():
        from openai import AsyncOpenAI

        async with InferenceClient([server.url], timeout=60, max_retries=0) as client:
            backend = Recording(client)
            async with Gateway(
                backend, tok, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=5, seq_len=256
            ) as gw:
                out = []
                for sid, agent in (("chat", _chat_agent), ("responses", _responses_agent)):
                    gw.open(sid)
                    oa = AsyncOpenAI(base_url=gw.base_url(sid), api_key="none", max_retries=0)
                    await agent(oa, a, b)
                    await oa.close()
                    out.append((await gw.finish(sid)).rollouts())
                return out, backend.calls

    try:
        with BackgroundServer(engine, tok) as server:
            (chat, responses), calls = asyncio.run(main())
    finally:
        engine.stop()
    return model, chat, responses, calls, (a, b)


def _pixels(processor: VisionProcessor, urls: list[str]) -> np.ndarray:
    """The processor's pixel rows of each image alone, concatenated in order."""
    rows = [processor.render([{"role": "user", "content": [_image(u)]}]).pixel_values for u in urls]
    return torch.cat(rows).numpy()


def _leaf_call(sample, calls) -> tuple[list[int], Any, Any]:
    """The backend call whose prompt + returned completion are the sample's ids (its leaf turn)."""
    ids = sample.prompt_ids + sample.completion_ids
    (hit,) = [(p, im, c) for p, im, out in calls for c in out if p + list(c.token_ids) == ids and len(p) < len(ids)]
    return hit


@pytest.mark.slow
def test_black_box_agents_with_images_train_token_exactly(vl_dir, tmp_path, monkeypatch) -> None:
    loads = []
    real = vision.load_image
    monkeypatch.setattr(vision, "load_image", lambda part: loads.append(part) or real(part))
    model, chat, responses, calls, (a, b) = _serve(vl_dir, tmp_path)
    # each call's images are read once, for its prompt (1 + 2 + 2 + 1 chat, 1 + 2 responses): recording the turn
    # takes the reply's tokens from the template's text (VisionProcessor.with_reply), not from a second rendering
    assert len(loads) == 9
    processor = VisionProcessor(vl_dir)
    assert len(calls) == 6 and all(im is not None for _, im, _ in calls)
    assert len(chat) == 2 and len(responses) == 1  # the chat agent's branch is a sample of its own
    expected_images = {0: [a, b], 1: [b]}  # the three-turn chain holds both images, the branch only the second
    for k, sample in enumerate([*chat, *responses]):
        prompt, images, completion = _leaf_call(sample, calls)
        urls = expected_images.get(k, [a, b])
        # the pixels trained are those the engine was given: the agent's images, rendered one by one, in order
        assert np.array_equal(np.asarray(sample.images["pixel_values"]), np.asarray(images["pixel_values"]))
        assert np.array_equal(np.asarray(sample.images["pixel_values"]), _pixels(processor, urls))
        assert np.asarray(sample.images["image_grid_thw"]).tolist() == [[1, 4, 4], [1, 4, 6]][2 - len(urls) :]
        # every token the engine returned in the chain is trained, with its logprob; nothing else is
        chain = [c for p, _, out in calls for c in out if (sample.prompt_ids + sample.completion_ids)[: len(p)] == p]
        sampled = [t for c in chain for t in c.token_ids]
        assert [t for t, m in zip(sample.completion_ids, sample.completion_mask) if m] == sampled
        assert [x for x, m in zip(sample.logprobs, sample.completion_mask) if m] == [
            x for c in chain for x in c.logprobs
        ]
        ids = sample.prompt_ids + sample.completion_ids
        assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4 * (len(urls) == 2) + 6
    turns = [
        sum(1 for i, m in enumerate(s.completion_mask) if m and (i == 0 or not s.completion_mask[i - 1])) for s in chat
    ]
    assert turns == [3, 1]  # the chain's three sampled turns, the branch's one
    (batch,) = build_step_batches(
        [*chat, *responses], step=0, ranks=1, micro_batch_tokens=512, temperature=1.0, pad_id=0
    )
    grids = [mb.image_grid_thw for mb in batch.micro_batches if mb.pixel_values is not None]
    assert sum(int(g.shape[0]) for g in grids) == 5
    for mb in batch.torch().micro_batches:  # as the trainer reads them
        with torch.no_grad():
            ours, _ = micro_batch_logprobs(model, mb, 1.0, torch.device("cpu"), with_entropy=False)
        assert (ours - mb.inference_logprobs)[mb.loss_mask].abs().max() <= 1e-4


def test_image_parts_are_refused_in_one_line_naming_the_field(vl_dir, tmp_path) -> None:
    image = _image(data_url(Image.new("RGB", (32, 32), "red")))
    chat = {"messages": [{"role": "user", "content": [_text("what?"), image]}]}
    responses = {"input": [{"role": "user", "content": [_image(image["image_url"]["url"], "input_image")]}]}

    def refused(tokenizer, body: dict, route: str) -> tuple[str, str]:
        with Served(FakeClient(), tokenizer=tokenizer) as srv:
            srv.open("s")
            status, raw = _post(f"{srv.gw.url}/v1/sessions/s/v1/{route}", body)
            assert srv.gw.sessions["s"].turns == []
        err = json.loads(raw)["error"]
        assert status == 400 and "\n" not in err["message"], (status, err)
        return err["param"], err["message"]

    text = ByteTokenizer()
    param, message = refused(text, chat, "chat/completions")
    assert param == "messages" and "text-only model" in message and "messages[0].content[1]" in message
    param, message = refused(text, responses, "responses")
    assert param == "input" and "text-only model" in message
    vl = load_tokenizer(vl_dir)
    cases = [
        (_image("https://example.com/cat.png"), "no downloads"),
        (_image(str(tmp_path / "missing.png")), "does not exist"),
        ({"type": "image_url", "image_url": {"url": 3}}, "data URL or a local path"),
        ({"type": "input_audio", "input_audio": {}}, "text or image_url part"),
    ]
    for part, why in cases:
        param, message = refused(vl, {"messages": [{"role": "user", "content": [part]}]}, "chat/completions")
        assert param == "messages" and why in message, message
    param, message = refused(
        vl, {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "responses"
    )
    assert param == "input" and "file_id" in message


def test_local_image_files_are_read_only_from_the_gateways_image_dirs(vl_dir, tmp_path) -> None:
    """`image_dirs` bounds the files agents may name: inside one (also as a file:// URL) the call is answered;
    outside, through a symlink that leaves it, with [] and by default beyond loopback, one 400 line naming the
    field and the setting; data URLs pass everywhere."""
    allowed, other = tmp_path / "images", tmp_path / "private"
    allowed.mkdir(), other.mkdir()
    Image.new("RGB", (32, 32), "red").save(allowed / "red.png")
    Image.new("RGB", (32, 32), "blue").save(other / "blue.png")
    (allowed / "link.png").symlink_to(other / "blue.png")
    vl = load_tokenizer(vl_dir)

    def post(cfg: GatewayConfig, url: str) -> tuple[int, dict]:
        body = {"messages": [{"role": "user", "content": [_text("what?"), _image(url)]}]}
        with Served(ImageBackend(vl, "red"), cfg=cfg, tokenizer=vl) as srv:
            srv.open("s")
            status, raw = _post(f"{srv.gw.url}/v1/sessions/s/v1/chat/completions", body)
        return status, json.loads(raw)

    inside = GatewayConfig(image_dirs=[str(allowed)])
    for url in (str(allowed / "red.png"), f"file://{allowed / 'red.png'}", data_url(Image.new("RGB", (8, 8)))):
        status, reply = post(inside, url)
        assert status == 200, reply
    beyond = GatewayConfig(host="0.0.0.0", api_key="k")  # noqa: S104 - the config, never bound here
    assert image_dirs(beyond) == [] and image_dirs(GatewayConfig()) is None
    for cfg, url in [
        (inside, str(other / "blue.png")),
        (inside, str(allowed / "link.png")),
        (GatewayConfig(image_dirs=[]), str(allowed / "red.png")),
    ]:
        status, reply = post(cfg, url)
        err = reply["error"]
        assert status == 400 and err["param"] == "messages" and "image_dirs" in err["message"], reply
        assert "\n" not in err["message"]


class ImageBackend(FakeClient):
    """FakeClient that takes a prompt's images and keeps them."""

    def __init__(self, tok: Any, answer: str) -> None:
        super().__init__(lambda p: answer, tok=tok)
        self.images: list[Any] = []

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=None, images=None):
        self.images.append(images)
        return await super().generate(prompt_ids, n, max_tokens, temperature, top_p, seed, stop)


def test_black_box_env_gives_image_tasks_as_content_parts_and_trains_them(vl_dir, tmp_path) -> None:
    """The black_box environment over `shapes`: the agent gets the task's content parts (the image as a data URL)
    as JSON, sends them over two turns; each episode's one sample carries the prompt's pixels."""
    from arbor.environments import env_prompt
    from arbor.environments.black_box import BlackBoxEnv
    from arbor.orchestrator.group import GroupSpec

    agent = tmp_path / "vision_agent.py"
    agent.write_text(
        "import json\n"
        "from openai import OpenAI\n"
        "def solve(task, base_url, api_key):\n"
        "    oa = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)\n"
        "    msgs = [{'role': 'user', 'content': json.loads(task)}]\n"
        "    r = oa.chat.completions.create(model='m', messages=msgs)\n"
        "    msgs.append({'role': 'assistant', 'content': r.choices[0].message.content})\n"
        "    msgs.append({'role': 'user', 'content': 'sure?'})\n"
        "    return oa.chat.completions.create(model='m', messages=msgs).choices[0].message.content\n"
    )
    env = BlackBoxEnv(function=f"{agent}:solve", tasks="shapes", task_args={"num_tasks": 4, "kinds": ["colour"]})
    task = env.dataset(0)[0]
    parts = json.loads(env.task_text(task))
    assert [p["type"] for p in parts] == ["image_url", "text"] and parts[0]["image_url"]["url"].startswith("data:")
    tok = load_tokenizer(vl_dir)
    backend = ImageBackend(tok, task["answer"])

    async def main():
        async with Gateway(backend, tok, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=8, seq_len=256) as gw:
            return await env.run_group(gw, GroupSpec(task, [], 0, group_id=1), 2, {}, 10.0)

    rollouts = asyncio.run(main())
    ids, images = env_prompt(env, task, tok)  # the inner prompt as the orchestrator renders it (a PIL image)
    assert len(rollouts) == 2 and all(r.reward == 1.0 for r in rollouts)  # one chain per episode, both right
    assert len(backend.images) == 4
    for r in rollouts:
        assert r.prompt_ids == ids and sum(r.completion_mask) == 2 * len(task["answer"]) + 2
        for key in ("pixel_values", "image_grid_thw"):
            assert np.array_equal(np.asarray(r.images[key]), np.asarray(images[key]))


def test_a_history_whose_image_was_swapped_starts_a_new_root(vl_dir) -> None:
    """Placeholder ids cannot tell two images of one size apart: the pixels decide whether a call extends a turn."""
    tok = load_tokenizer(vl_dir)
    red, green = (data_url(Image.new("RGB", (32, 32), c)) for c in ("red", "green"))

    def user(url: str) -> dict[str, Any]:
        return {"role": "user", "content": [_image(url), _text("colour?")]}

    with Served(ImageBackend(tok, "ok"), tokenizer=tok) as srv:
        s = srv.open()
        url = srv.gw.base_url(s.id) + "/chat/completions"
        status, raw = _post(url, {"messages": [user(red)]})
        reply = json.loads(raw)["choices"][0]["message"]["content"]
        for first in (red, green):  # the same history, then one whose first image is another of the same size
            history = [user(first), {"role": "assistant", "content": reply}, {"role": "user", "content": "sure?"}]
            assert _post(url, {"messages": history})[0] == 200
        assert [t.parent for t in s.turns] == [None, 0, None]
        assert s.turns[2].prompt_ids[: len(s.turns[0].prompt_ids)] == s.turns[0].prompt_ids  # same ids so far
        assert len(s.rollouts()) == 2
