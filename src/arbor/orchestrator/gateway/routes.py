"""The gateway's aiohttp handlers: session management (`SessionRoutes`) and the OpenAI API (`OpenAIRoutes`).

Session management opens sessions over HTTP, hands queued work to remote agents (pull mode), shows a session and
takes its reward. The OpenAI routes find the call's session (path `/v1/sessions/{id}/v1/...` or the
`X-Session-Id` header), render and sample through arbor.orchestrator.gateway.openai_wire and the inference client,
record every choice in the session's trajectory and answer in OpenAI JSON or as server-sent events. A completion
cut at a stop string is recorded without the stop string's tokens when they start at a token boundary (what the
agent saw is what trains; `trim_at_stop`), and a response whose temperature the run replaced says so in
`X-Arbor-Temperature-Override`; both are counted in the store's `GatewayCounts`. The server that mounts them,
with auth, size limits and the count of refused requests, is arbor.orchestrator.gateway.service.

Images: with a vision-language tokenizer (arbor.models.vision) chat `image_url` parts and Responses
`input_image` parts (a data URL or a local path) are rendered by the model's processor; the call carries the
prompt's pixel inputs to the backend and its turn keeps them (arbor.orchestrator.trajectory). A text model
refuses image parts, and any model an http(s) image URL, in one line naming the field.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from arbor.models.image_parts import ImageRefused, refuse_local_images_outside
from arbor.models.tokenizer import Tokenizer
from arbor.orchestrator.client import Completion, InferenceError
from arbor.orchestrator.gateway.openai_wire import (
    RunSampling,
    chat_choices,
    chat_chunks,
    check_request,
    completion_choices,
    parse_token_prompt,
    token_usage,
    trim_at_stop,
)
from arbor.orchestrator.gateway.responses import (
    input_messages,
    instructions,
    output_items,
    response_object,
    sampling_body,
    stream_events,
)
from arbor.orchestrator.gateway.responses import parse_tools as response_tools
from arbor.orchestrator.gateway.sessions import Session, SessionStore
from arbor.orchestrator.trajectory import Images, Prompt
from arbor.transport.chat import chat_tools, parse_messages, template_message
from arbor.transport.fields import CHAT, COMPLETIONS, RESPONSES
from arbor.transport.http import HTTPError, get_field, get_float, read_json_object

if TYPE_CHECKING:
    from arbor.orchestrator.client import InferenceClient

SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
TEMPERATURE_HEADER = "X-Arbor-Temperature-Override"
"""Set on a response whose request's temperature was replaced by the run's: `<agent's>-><used>`."""


def session_url(root: str, session_id: str) -> str:
    """The URL prefix of a session's routes on the gateway at `root`."""
    return f"{root}/v1/sessions/{session_id}"


def _session_id(request: web.Request) -> str | None:
    return request.match_info.get("sid") or request.headers.get("X-Session-Id")


async def _optional_body(request: web.Request) -> dict[str, Any]:
    return await read_json_object(request) if request.can_read_body else {}


class SessionRoutes:
    """POST /v1/sessions, POST /v1/work, GET /v1/sessions/{id}, POST /v1/sessions/{id}/reward."""

    def __init__(self, store: SessionStore, root: Callable[[], str]) -> None:
        self.store = store
        # The gateway's URL is known only once it is bound: asked for when a reply names a URL.
        self.root = root

    async def open_session(self, request: web.Request) -> web.Response:
        body = await _optional_body(request)
        sid = get_field(body, "id", (str,), None)
        if sid is not None and not SESSION_ID.fullmatch(sid):
            raise HTTPError(400, "id must be 1-128 characters of letters, digits, '.', '_' or '-'", "id")
        s = self.store.open(sid, get_field(body, "task_id", (int, str), -1))
        s.external = True
        return web.json_response({"id": s.id, "base_url": session_url(self.root(), s.id) + "/v1"}, status=201)

    async def claim_work(self, request: web.Request) -> web.Response:
        """Pull mode: the next queued task and its session for a remote agent, waiting up to `wait` seconds;
        204 when there is none."""
        body = await _optional_body(request)
        wait = get_float(body, "wait", 0.0, 0.0, 60.0)
        claimed = await self.store.claim(wait)
        if claimed is None:
            return web.Response(status=204)
        sid, task = claimed
        prefix = session_url(self.root(), sid)
        return web.json_response(
            {"session_id": sid, "base_url": prefix + "/v1", "task": task, "reward_url": prefix + "/reward"}
        )

    async def show_session(self, request: web.Request) -> web.Response:
        s = self.store.get(request.match_info["sid"])
        return web.json_response(
            {
                "id": s.id,
                "closed": s.closed,
                "turns": len(s.turns),
                "reward": s.reward,
                "samples": s.trajectory.num_branches,
            }
        )

    async def reward(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        self.store.get(sid)
        body = await read_json_object(request)
        value = get_field(body, "reward", (int, float), None)
        if value is None or not math.isfinite(value):
            raise HTTPError(400, "reward (a finite number) is required", "reward")
        comps = get_field(body, "components", (dict,), {})
        if not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for k, v in comps.items()
        ):
            raise HTTPError(400, "components must map names to finite numbers", "components")
        s = self.store.close(sid, float(value), {k: float(v) for k, v in comps.items()})
        return web.json_response({"id": sid, "closed": True, "turns": len(s.turns)})


class OpenAIRoutes:
    """POST /v1/chat/completions, POST /v1/responses, POST /v1/completions, GET /v1/models, each recording into
    its session."""

    def __init__(
        self,
        client: "InferenceClient",
        tokenizer: Tokenizer,
        store: SessionStore,
        sampling: RunSampling,
        model_name: str,
        image_dirs: list[Path] | None = None,
    ) -> None:
        self.client = client
        self.image_dirs = image_dirs  # where agents' local image files may lie (None: anywhere)
        self.tokenizer = tokenizer
        self.store = store
        self.sampling = sampling
        self.model_name = model_name
        self.calls = 0  # answered calls, for the gateway's health and metrics
        # Why image parts are refused (None: a vision-language tokenizer renders them)
        self.images: str | None = None
        if not hasattr(tokenizer, "render_images"):
            name = getattr(tokenizer, "name", model_name)
            self.images = f"model {name} is a text-only model: send text (images need a vision-language model)"

    async def models(self, request: web.Request) -> web.Response:
        sid = _session_id(request)
        if sid is not None:  # optional here, but an unknown one is still a 404
            self.store.get(sid)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "arbor",
                        "max_model_len": self.sampling.seq_len,
                    }
                ],
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        body = await read_json_object(request)
        check_request(body, CHAT)
        # A forced call is refused as on the servers; the reply's calls are parsed whatever tool_choice says
        # (an agent's loop reads tool_calls, and an echoed reply renders alike either way)
        messages, (tools, _) = parse_messages(body, self.images), chat_tools(body)
        stream = get_field(body, "stream", (bool,), False)
        include_usage = bool((get_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        prompt = _render(s, messages, tools, "messages", self.image_dirs)
        sampling = self.sampling.parse(body, len(prompt.ids))
        completions = await self._generate(s, prompt.ids, sampling, prompt.images)
        headers = self._override_headers(body)
        choices = chat_choices(completions)
        for choice, c in zip(choices, completions):
            s.trajectory.record(prompt, c, template_message(choice["message"], 0))
        self.calls += 1
        usage = token_usage(prompt.ids, completions)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if not stream:
            return web.json_response({**head, "choices": choices, "usage": usage}, headers=headers)
        chunks = chat_chunks({**head, "object": "chat.completion.chunk"}, choices, usage if include_usage else None)
        return await _sse(request, chunks, headers)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API (arbor.orchestrator.gateway.responses): the same rendering, sampling and recording
        as a chat call, one reply per request."""
        s = self._session(request)
        body = await read_json_object(request)
        check_request(body, RESPONSES)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in s.responses:
            raise HTTPError(
                400,
                f"previous_response_id {previous!r} is not a stored response of this session",
                "previous_response_id",
            )
        new = [
            template_message(m, i, self.images) for i, m in enumerate(input_messages(body.get("input"), self.images))
        ]
        conversation = (s.responses[previous] if previous is not None else []) + new
        stream = get_field(body, "stream", (bool,), False)
        prompt = _render(s, instructions(body) + conversation, response_tools(body), "input", self.image_dirs)
        sampling = sampling_body(body)
        (completion,) = await self._generate(
            s, prompt.ids, self.sampling.parse(sampling, len(prompt.ids)), prompt.images
        )
        headers = self._override_headers(sampling)
        items, reply = output_items(completion)
        s.trajectory.record(prompt, completion, reply)
        self.calls += 1
        response = response_object(body, self.model_name, items, completion, len(prompt.ids))
        if get_field(body, "store", (bool,), True):  # store: false (stateless agents) keeps nothing to continue
            s.responses[response["id"]] = conversation + [reply]
        if not stream:
            return web.json_response(response, headers=headers)
        return await _sse(request, stream_events(response), headers, named=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        body = await read_json_object(request)
        check_request(body, COMPLETIONS)
        prompt = parse_token_prompt(body, self.tokenizer)
        stream = get_field(body, "stream", (bool,), False)
        sampling = self.sampling.parse(body, len(prompt))
        recorded = s.trajectory.token_prompt(prompt)
        completions = await self._generate(s, prompt, sampling)
        headers = self._override_headers(body)
        for c in completions:
            s.trajectory.record(recorded, c)
        self.calls += 1
        choices = completion_choices(completions)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if not stream:
            return web.json_response(
                {**head, "choices": choices, "usage": token_usage(prompt, completions)}, headers=headers
            )
        return await _sse(request, [{**head, "choices": [ch]} for ch in choices], headers)

    def _session(self, request: web.Request) -> Session:
        """The open session a generation call is made in."""
        sid = _session_id(request)
        if sid is None:
            raise HTTPError(400, "no session: call {gateway}/v1/sessions/{id}/v1/... or send X-Session-Id")
        s = self.store.get(sid)
        if s.closed:
            raise HTTPError(409, f"session {sid!r} is closed", kind="conflict_error")
        return s

    def _override_headers(self, body: dict[str, Any]) -> dict[str, str]:
        """The signal (and count) that the run's temperature replaced the agent's."""
        override = self.sampling.temperature_override(body)
        if override is None:
            return {}
        self.store.counts.temperature_overrides += 1
        return {TEMPERATURE_HEADER: override}

    async def _generate(
        self, s: Session, prompt: list[int], sampling: dict[str, Any], images: Images | None = None
    ) -> list[Completion]:
        """The backend's completions, each trimmed to the text the agent gets when a stop string cut it;
        `images`: the prompt's pixel inputs (its image placeholders are in `prompt`)."""
        completions = await self._backend(s, prompt, {**sampling, "images": images} if images else sampling)
        out, counts = [], self.store.counts
        for c in completions:
            c, trim = trim_at_stop(c, self.tokenizer)
            counts.stop_trimmed += trim == "trimmed"
            counts.stop_untrimmed += trim == "untrimmed"
            out.append(c)
        return out

    async def _backend(self, s: Session, prompt: list[int], sampling: dict[str, Any]) -> list[Completion]:
        with self.store.generating(s):
            try:
                return await self.client.generate(prompt, **sampling)
            except InferenceError as e:  # the backend refusing this request is the agent's error, else the fleet's
                if e.status is not None and 400 <= e.status < 500:
                    raise HTTPError(400, f"the inference backend rejected the request: {e}") from None
                raise HTTPError(502, f"inference backend: {e}", None, "api_error") from None


def _render(
    s: Session, messages: list[dict[str, Any]], tools: list[dict] | None, field: str, image_dirs: list[Path] | None
) -> Prompt:
    """The session's prompt for a chat-style call; a template that rejects these messages is the client's problem."""
    try:
        refuse_local_images_outside(messages, image_dirs)
        return s.trajectory.chat_prompt(messages, tools)
    except ImageRefused as e:  # a text model, an http(s) URL, a file outside image_dirs or missing, too many/large
        raise HTTPError(400, str(e), field) from None
    except Exception as e:
        raise HTTPError(400, f"{field} could not be rendered with the chat template: {e}", field) from None


async def _sse(
    request: web.Request, chunks: list[dict[str, Any]], headers: dict[str, str], named: bool = False
) -> web.StreamResponse:
    """Server-sent events: chat's `data:` chunks ended by `[DONE]`, or (`named`) the Responses API's events, each
    under its `event:` type, ended by the last event."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    for c in chunks:
        event = f"event: {c['type']}\n" if named else ""
        await resp.write(f"{event}data: {json.dumps(c)}\n\n".encode())
    if not named:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
