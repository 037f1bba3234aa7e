"""The gateway: an OpenAI-compatible server that records a black-box agent's model calls as training samples.

An agent that only knows the `openai` package is pointed at a session:

    OPENAI_BASE_URL = {gateway}/v1/sessions/{session_id}/v1     (or base_url {gateway}/v1 + X-Session-Id header)
    OPENAI_API_KEY  = the gateway's api_key (any string when none is set)

Routes (under the session prefix `/v1/sessions/{id}` or with the header): POST /v1/chat/completions (with
`stream: true` as server-sent events in OpenAI's chunk format), POST /v1/completions, GET /v1/models. Session
management: POST /v1/sessions (open; body `{"id"?, "task_id"?}`), GET /v1/sessions/{id},
POST /v1/sessions/{id}/reward `{"reward": float, "components": {name: float}}` (closes it), GET /health.
Pull mode (agents on other machines, the black_box environment with `remote = true`): POST /v1/work
`{"wait": seconds}` claims the next task as `{"session_id", "base_url", "task", "reward_url"}` (204: none yet);
the agent runs against `base_url` and POSTs its reward to `reward_url`.

For every call the gateway renders the messages with the chat template itself (tools included; like AReaL's and
slime's proxies), sends token ids to the inference fleet (`InferenceClient.generate`: logprobs, per-token policy
versions, routed experts), records them in the session's trajectory (arbor.orchestrator.trajectory: token-exact
extension; a history that does not extend a recorded turn branches, never spliced) and answers with ordinary
OpenAI JSON: the text, `tool_calls` parsed from `<tool_call>{json}</tool_call>` blocks (the Hermes/Qwen
convention, arbor.environments.tools), usage. Streaming is generated whole, then sent as a role chunk, one
content chunk, a finish chunk (and a usage chunk when `stream_options.include_usage`): the backend API returns
token ids only for whole completions. Errors: malformed JSON or wrong types 400, bad or missing key 401, unknown
session 404, closed session 409, body over `max_request_bytes` 413, too many sessions 429, backend failure 502;
never a 500 for client input. There is no global lock: each call awaits its own backend request.

Departure from OpenAI: sampling follows the run (`override_sampling`), not the agent's temperature, because
the trainer's importance ratios assume the run's distribution; `n` > 1 records each choice as its own turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from arbor.environments.tools import parse_tool_calls
from arbor.orchestrator.client import InferenceError
from arbor.orchestrator.trajectory import Trajectory, Turn
from arbor.transport.http import HTTPError, error_middleware, error_response, get_field, read_json_object, start_site

if TYPE_CHECKING:
    from arbor.config.orchestrator import GatewayConfig
    from arbor.orchestrator.client import InferenceClient
    from arbor.orchestrator.rollout import Rollout

log = logging.getLogger("arbor.orchestrator.gateway")

MAX_N = 16
TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


# ---- request parsing ----

def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
    """A chat message in the form the template renders: the same for a request's messages and for the reply the
    gateway gave, so that a reply echoed back renders as the recorded one (arbor.orchestrator.trajectory)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise HTTPError(400, f"messages[{i}] must be an object with a string role", "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise HTTPError(400, f"messages[{i}].content parts must be text parts", "messages")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls)):
        raise HTTPError(400, f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}",
                        "messages")
    clean = {"role": m["role"], "content": content or ""}
    if calls:
        clean["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in calls]
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            clean[key] = m[key]
    return clean


def _arguments(args: Any) -> Any:
    # Templates want the arguments as a mapping; clients send the JSON string OpenAI returned.
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


def _tools(body: dict[str, Any]) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise HTTPError(400, "tools must be a list of objects", "tools")
    return tools or None


def _seed(body: dict[str, Any]) -> int | None:
    seed = get_field(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed < 2**63:
        raise HTTPError(400, f"seed must be in [0, 2**63), got {seed}", "seed")
    return seed


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise HTTPError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    return stop


# ---- parsing ----

def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """OpenAI `tool_calls` from the completion's `<tool_call>` blocks (arbor.environments.tools) and the text
    outside them; with any malformed block the whole text stays content, so the agent sees what was sampled."""
    calls, errors = parse_tool_calls(text)
    if not calls or errors:
        return text, []
    out = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return TOOL_CALL.sub("", text).strip(), out


# ---- sessions ----

@dataclasses.dataclass
class Session:
    """One agent run: the tree of its model calls (arbor.orchestrator.trajectory), its reward, its state."""

    id: str
    trajectory: Trajectory
    task_id: int | str = -1
    group_id: int = -1
    closed: bool = False
    reward: float | None = None
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    external: bool = False
    """Opened over HTTP (POST /v1/sessions) rather than by an environment: served and recorded, not trained on."""
    pending: int = 0
    """Calls being generated; a session closed meanwhile still records them (the agent saw their answers)."""

    @property
    def turns(self) -> list[Turn]:
        return self.trajectory.turns

    def rollouts(self, episode_id: int = -1) -> list["Rollout"]:
        """One sample per chain of calls with the session's reward; `episode_id`: its index in its group."""
        return self.trajectory.rollouts(self.task_id, self.reward or 0.0, self.components, group_id=self.group_id,
                                        episode_id=episode_id)


# ---- the server ----

class Gateway:
    """Sessions plus the aiohttp application; runs on the caller's event loop (the orchestrator's)."""

    def __init__(self, client: "InferenceClient", tokenizer: Any, cfg: "GatewayConfig", *, temperature: float,
                 top_p: float, max_tokens: int, seq_len: int) -> None:
        self.client, self.tokenizer, self.cfg = client, tokenizer, cfg
        self.temperature, self.top_p, self.max_tokens, self.seq_len = temperature, top_p, max_tokens, seq_len
        self.sessions: dict[str, Session] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._rewarded: dict[str, asyncio.Event] = {}
        self._work: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.calls = 0

    # -- session API for in-process users (the black_box environment) --

    def open(self, session_id: str | None = None, task_id: int | str = -1, group_id: int = -1) -> Session:
        if len(self.sessions) >= self.cfg.max_open_sessions:
            # Sessions opened over HTTP have no in-process owner to finish them: closed ones make room.
            for sid in [k for k, v in self.sessions.items() if v.external and v.closed and not v.pending]:
                del self.sessions[sid], self._idle[sid], self._rewarded[sid]
        if len(self.sessions) >= self.cfg.max_open_sessions:
            raise HTTPError(429, f"{len(self.sessions)} sessions are open (max_open_sessions)", kind="rate_limit_error")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise HTTPError(409, f"session {sid!r} exists", "id")
        s = self.sessions[sid] = Session(sid, Trajectory(self.tokenizer), task_id, group_id)
        self._idle[sid] = asyncio.Event()
        self._idle[sid].set()
        self._rewarded[sid] = asyncio.Event()
        return s

    def base_url(self, session_id: str) -> str:
        """What an agent's OPENAI_BASE_URL should be for this session."""
        return f"{self.url}/v1/sessions/{session_id}/v1"

    def close(self, session_id: str, reward: float | None = None, components: dict[str, float] | None = None) -> Session:
        s = self._session(session_id)
        if s.closed:
            raise HTTPError(409, f"session {session_id!r} is closed", kind="conflict_error")
        s.closed, s.reward, s.components = True, reward, dict(components or {})
        self._rewarded[session_id].set()
        return s

    def offer(self, session_id: str, task: str) -> None:
        """Queues a session for a remote agent to claim with POST /v1/work (pull mode)."""
        self._work.put_nowait((session_id, task))

    async def wait_reward(self, session_id: str, timeout: float) -> bool:
        """Waits until the session is closed by a reward POST; False on timeout."""
        try:
            await asyncio.wait_for(self._rewarded[session_id].wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def finish(self, session_id: str) -> Session:
        """Closes (if open), waits for calls still generating, and forgets the session; returns it."""
        s = self._session(session_id)
        s.closed = True
        await self._idle[session_id].wait()
        del self.sessions[session_id], self._idle[session_id], self._rewarded[session_id]
        return s

    def _session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise HTTPError(404, f"unknown session {session_id!r}", kind="not_found_error")
        return s

    # -- lifecycle --

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, error_middleware(log)], client_max_size=self.cfg.max_request_bytes)
        s = "/v1/sessions/{sid}"
        app.add_routes([
            web.get("/health", self.health),
            web.post("/v1/sessions", self.open_session),
            web.post("/v1/work", self.claim_work),
            web.get(s, self.show_session),
            web.post(s + "/reward", self.reward),
            web.post(s + "/v1/chat/completions", self.chat),
            web.post(s + "/v1/completions", self.completions),
            web.get(s + "/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
        ])
        return app

    async def start(self) -> str:
        self._runner, self.url = await start_site(self.app(), self.cfg.host, self.cfg.port)
        log.info("gateway ready at %s (agents: OPENAI_BASE_URL=%s)", self.url, self.base_url("<session>"))
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "Gateway":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.cfg.api_key
        if key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
            if not hmac.compare_digest(token.encode(), key.encode()):
                return error_response(401, "missing or wrong API key (Authorization: Bearer <key>)", None, "authentication_error")
        # aiohttp reads lazily: refuse a declared oversize body before reading any of it.
        if request.content_length is not None and request.content_length > self.cfg.max_request_bytes:
            return error_response(413, f"request body of {request.content_length} bytes exceeds {self.cfg.max_request_bytes}")
        return await handler(request)

    # -- handlers --

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "open_sessions": len(self.sessions), "calls": self.calls})

    async def models(self, request: web.Request) -> web.Response:
        self._route_session(request, required=False)
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "arbor",
            "max_model_len": self.seq_len}]})

    async def open_session(self, request: web.Request) -> web.Response:
        body = await read_json_object(request) if request.can_read_body else {}
        sid = get_field(body, "id", (str,), None)
        if sid is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", sid):
            raise HTTPError(400, "id must be 1-128 characters of letters, digits, '.', '_' or '-'", "id")
        s = self.open(sid, get_field(body, "task_id", (int, str), -1))
        s.external = True
        return web.json_response({"id": s.id, "base_url": self.base_url(s.id)}, status=201)

    async def claim_work(self, request: web.Request) -> web.Response:
        """Pull mode: the next queued task and its session for a remote agent, waiting up to `wait` seconds;
        204 when there is none."""
        body = await read_json_object(request) if request.can_read_body else {}
        wait = get_field(body, "wait", (int, float), 0)
        if not 0 <= wait <= 60:
            raise HTTPError(400, f"wait must be in [0, 60] seconds, got {wait}", "wait")
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            try:
                sid, task = self._work.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return web.Response(status=204)
                try:
                    sid, task = await asyncio.wait_for(self._work.get(), left)
                except asyncio.TimeoutError:
                    return web.Response(status=204)
            s = self.sessions.get(sid)
            if s is not None and not s.closed:  # skip work whose rollout already gave up
                return web.json_response({"session_id": sid, "base_url": self.base_url(sid), "task": task,
                                          "reward_url": f"{self.url}/v1/sessions/{sid}/reward"})

    async def show_session(self, request: web.Request) -> web.Response:
        s = self._session(request.match_info["sid"])
        return web.json_response({"id": s.id, "closed": s.closed, "turns": len(s.turns), "reward": s.reward,
                                  "samples": s.trajectory.num_branches})

    async def reward(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        self._session(sid)
        body = await read_json_object(request)
        value = get_field(body, "reward", (int, float), None)
        if value is None or not math.isfinite(value):
            raise HTTPError(400, "reward (a finite number) is required", "reward")
        comps = get_field(body, "components", (dict,), {})
        if not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) for k, v in comps.items()):
            raise HTTPError(400, "components must map names to finite numbers", "components")
        s = self.close(sid, float(value), {k: float(v) for k, v in comps.items()})
        return web.json_response({"id": sid, "closed": True, "turns": len(s.turns)})

    def _route_session(self, request: web.Request, required: bool = True) -> Session | None:
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id")
        if sid is None:
            if required:
                raise HTTPError(400, "no session: call {gateway}/v1/sessions/{id}/v1/... or send X-Session-Id")
            return None
        s = self._session(sid)
        if s.closed and required:
            raise HTTPError(409, f"session {sid!r} is closed", kind="conflict_error")
        return s

    def _sampling(self, body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        max_tokens = get_field(body, "max_completion_tokens", (int,), None)
        max_tokens = get_field(body, "max_tokens", (int,), None) if max_tokens is None else max_tokens
        temperature = get_field(body, "temperature", (int, float), self.temperature)
        top_p = get_field(body, "top_p", (int, float), self.top_p)
        n = get_field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise HTTPError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
        if max_tokens is not None and max_tokens < 1:
            raise HTTPError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if not 0 <= temperature or not 0 < top_p <= 1:
            raise HTTPError(400, "temperature must be >= 0 and top_p in (0, 1]", "temperature")
        if self.cfg.override_sampling:
            temperature, top_p = self.temperature, self.top_p
            max_tokens = min(max_tokens or self.max_tokens, self.max_tokens)
        room = self.seq_len - prompt_len
        if room < 1:
            raise HTTPError(400, f"the prompt has {prompt_len} tokens; the run's seq_len is {self.seq_len}",
                            "messages", "context_length_exceeded")
        return {"n": n, "max_tokens": min(max_tokens or room, room), "temperature": float(temperature),
                "top_p": float(top_p), "seed": _seed(body), "stop": _stop(body)}

    async def _generate(self, s: Session, prompt: list[int], sampling: dict[str, Any]):
        s.pending += 1
        self._idle[s.id].clear()
        try:
            return await self.client.generate(prompt, **sampling)
        except InferenceError as e:  # the backend refusing this request is the agent's error, else the fleet's
            if e.status is not None and 400 <= e.status < 500:
                raise HTTPError(400, f"the inference backend rejected the request: {e}") from None
            raise HTTPError(502, f"inference backend: {e}", None, "api_error") from None
        finally:
            s.pending -= 1
            if s.pending == 0 and s.id in self._idle:
                self._idle[s.id].set()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        s = self._route_session(request)
        body = await read_json_object(request)
        messages, tools = _messages(body), _tools(body)
        stream = get_field(body, "stream", (bool,), False)
        include_usage = bool((get_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        try:
            prompt = s.trajectory.chat_prompt(messages, tools)
        except Exception as e:  # a template that rejects these messages is the client's problem
            raise HTTPError(400, f"messages could not be rendered with the chat template: {e}", "messages") from None
        sampling = self._sampling(body, len(prompt.ids))
        completions = await self._generate(s, prompt.ids, sampling)
        choices = []
        for i, c in enumerate(completions):
            content, calls = split_tool_calls(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
            s.trajectory.record(prompt, c, _message(message, 0))
        self.calls += 1
        usage = _usage(prompt.ids, completions)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not stream:
            return web.json_response({"id": rid, "object": "chat.completion", "created": created,
                                      "model": self.cfg.model_name, "choices": choices, "usage": usage})
        chunks = []
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_name}
        for ch in choices:
            m = ch["message"]
            chunks.append({**head, "choices": [{"index": ch["index"], "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]})
            delta: dict[str, Any] = {"content": m["content"]} if m["content"] else {}
            if m.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(m["tool_calls"])]
            if delta:
                chunks.append({**head, "choices": [{"index": ch["index"], "delta": delta, "finish_reason": None}]})
            chunks.append({**head, "choices": [{"index": ch["index"], "delta": {},
                                                "finish_reason": ch["finish_reason"]}]})
        if include_usage:
            chunks.append({**head, "choices": [], "usage": usage})
        return await _sse(request, chunks)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        s = self._route_session(request)
        body = await read_json_object(request)
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompt = self.tokenizer.encode(raw)
        elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = list(raw)
        else:
            raise HTTPError(400, "prompt must be a string or a non-empty list of token ids (one prompt)", "prompt")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt):
            raise HTTPError(400, f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", "prompt")
        stream = get_field(body, "stream", (bool,), False)
        sampling = self._sampling(body, len(prompt))
        recorded = s.trajectory.token_prompt(prompt)
        completions = await self._generate(s, prompt, sampling)
        choices = []
        for i, c in enumerate(completions):
            choices.append({"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None})
            s.trajectory.record(recorded, c)
        self.calls += 1
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_name}
        if not stream:
            return web.json_response({**head, "choices": choices, "usage": _usage(prompt, completions)})
        return await _sse(request, [{**head, "choices": [ch]} for ch in choices])


def _usage(prompt: list[int], completions: list[Any]) -> dict[str, int]:
    done = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


async def _sse(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(f"data: {json.dumps(c)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
