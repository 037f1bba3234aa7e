"""Black-box agents lose nothing silently: an agent's refused requests, sessions that end without a posted
reward, temperature overrides and stop-string cuts are all counted in the gateway's figures; a session closed by
its reward no longer counts as open; a subprocess agent is told where to post its reward."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from test_gateway import TOK, FakeClient, Served, _openai, _post, _spec

from arbor.config.orchestrator import GatewayConfig
from arbor.environments.black_box import AgentGateway, AgentGroup, AgentSample, AgentSession, BlackBoxEnv
from arbor.orchestrator.client import Completion
from arbor.orchestrator.gateway.openai_wire import trim_at_stop
from arbor.orchestrator.gateway.routes import TEMPERATURE_HEADER
from arbor.orchestrator.gateway.service import Gateway
from arbor.orchestrator.rollout import Rollout


def test_the_orchestrator_drives_black_box_through_the_protocols_it_defines() -> None:
    """arbor.environments.black_box imports nothing of the orchestrator: it types what it is given. The gateway, its
    sessions, the group spec and the rollouts it records are what those Protocols ask for."""
    gw = Gateway(FakeClient(), TOK, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=64)
    assert isinstance(gw, AgentGateway) and isinstance(gw.open("s", task_id=0, group_id=3), AgentSession)
    assert isinstance(_spec(), AgentGroup)
    assert isinstance(Rollout(0, [1], [2], [0.0], [0], "x", "stop"), AgentSample)


@pytest.mark.slow
def test_refused_requests_are_counted_by_status_class() -> None:
    with Served(FakeClient(), GatewayConfig(api_key="k")) as srv:
        srv.open("a")
        url = srv.gw.base_url("a")
        assert _post(url + "/chat/completions", {"messages": []}, {"Authorization": "Bearer k"})[0] == 400
        assert _post(url + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0] == 401
        assert (
            _post(
                srv.gw.base_url("nobody") + "/chat/completions",
                {"messages": [{"role": "user", "content": "x"}]},
                {"Authorization": "Bearer k"},
            )[0]
            == 404
        )
        oa = _openai(url, "k")
        assert oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]).choices
        figures = srv.gw.figures()
        assert figures["gateway/rejected_4xx"] == 3 and figures["gateway/rejected_5xx"] == 0
        assert figures["gateway/calls"] == 1


def test_a_failing_backend_is_a_5xx_in_the_count() -> None:
    class Down(FakeClient):
        async def generate(self, *a, **k):
            from arbor.orchestrator.client import InferenceError

            raise InferenceError("fleet down")

    with Served(Down()) as srv:
        srv.open("a")
        status, _ = _post(srv.gw.base_url("a") + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert status == 502 and srv.gw.figures()["gateway/rejected_5xx"] == 1


def test_temperature_override_is_signalled_and_counted() -> None:
    client = FakeClient()
    with Served(client) as srv:
        srv.open("a")
        oa = _openai(srv.gw.base_url("a"))
        raw = oa.chat.completions.with_raw_response.create(
            model="m", temperature=0.2, messages=[{"role": "user", "content": "x"}]
        )
        assert raw.headers[TEMPERATURE_HEADER] == "0.2->1" and client.requests[-1]["temperature"] == 1.0
        same = oa.chat.completions.with_raw_response.create(
            model="m", temperature=1.0, messages=[{"role": "user", "content": "x"}]
        )
        assert TEMPERATURE_HEADER not in same.headers
        plain = oa.completions.with_raw_response.create(model="m", prompt="x", temperature=0.7, stream=True)
        assert plain.headers[TEMPERATURE_HEADER] == "0.7->1"
        assert srv.gw.figures()["gateway/temperature_overrides"] == 2
    with Served(FakeClient(), GatewayConfig(override_sampling=False)) as srv:  # the agent's own temperature: no signal
        srv.open("a")
        raw = _openai(srv.gw.base_url("a")).chat.completions.with_raw_response.create(
            model="m", temperature=0.2, messages=[{"role": "user", "content": "x"}]
        )
        assert TEMPERATURE_HEADER not in raw.headers and srv.gw.figures()["gateway/temperature_overrides"] == 0


def test_open_sessions_do_not_count_sessions_closed_by_their_reward() -> None:
    with Served(FakeClient()) as srv:
        srv.open("a")
        srv.open("b")
        assert srv.gw.open_sessions == 2
        assert _post(srv.gw.url + "/v1/sessions/a/reward", {"reward": 1.0})[0] == 200
        assert "a" in srv.gw.sessions and srv.gw.open_sessions == 1  # held for its owner, but closed
        assert srv.gw.figures()["gateway/open_sessions"] == 1
        assert _post(srv.gw.url + "/health", b"", method="GET")[1].count(b'"open_sessions": 1') == 1


REWARDING_AGENT = (
    "import json, os, sys, urllib.request\n"
    "from openai import OpenAI\n"
    "OpenAI().chat.completions.create(model='m', messages=[{'role': 'user', 'content': sys.argv[1]}])\n"
    "assert os.environ['ARBOR_REWARD_URL'].endswith('/v1/sessions/' + os.environ['ARBOR_SESSION_ID'] + '/reward')\n"
    "req = urllib.request.Request(os.environ['ARBOR_REWARD_URL'], json.dumps({'reward': 0.5}).encode(),\n"
    "    {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
    "urllib.request.urlopen(req).read()\n"
    "import time; time.sleep(float(os.environ.get('LINGER', '0')))\n"
)


@pytest.mark.slow
def test_a_subprocess_agent_posts_to_arbor_reward_url_and_its_closed_session_is_not_open(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(REWARDING_AGENT)
    env = BlackBoxEnv(command=[sys.executable, str(agent)], extra_env={"LINGER": "1.5"})

    async def main():
        async with Gateway(
            FakeClient(), TOK, GatewayConfig(api_key="k"), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=64
        ) as gw:
            from test_gateway import _spec

            run = asyncio.create_task(env.run_group(gw, _spec(), 2, {}, 10.0))
            seen = []
            while not run.done():  # the agents linger after posting: their sessions are held, closed
                seen.append((len(gw.sessions), gw.open_sessions))
                await asyncio.sleep(0.05)
            return await run, seen, gw.figures()

    rollouts, seen, figures = asyncio.run(main())
    assert [r.reward for r in rollouts] == [0.5, 0.5]
    assert (2, 0) in seen  # both rewarded and still running: held, not open
    assert (
        figures["gateway/open_sessions"] == 0
        and sum(v for k, v in figures.items() if k.startswith("gateway/unrewarded/")) == 0
    )


@pytest.mark.slow
def test_sessions_without_a_reward_are_counted_by_why_they_ended() -> None:
    quiet = BlackBoxEnv(command=[sys.executable, "-c", "print('cba')"])  # exits cleanly, never posts
    failing = BlackBoxEnv(command=[sys.executable, "-c", "import sys; sys.exit(3)"], retries=1)
    hanging = BlackBoxEnv(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5, retries=0)
    lonely = BlackBoxEnv(remote=True, timeout=0.2, retries=1)  # nobody claims the work: no reward in time

    async def main():
        async with Gateway(
            FakeClient(), TOK, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=64
        ) as gw:
            from test_gateway import _spec

            scored = await quiet.run_group(gw, _spec(), 2, {}, 10.0)
            assert await failing.run_group(gw, _spec(), 1, {}, 10.0) == []
            assert await hanging.run_group(gw, _spec(), 1, {}, 10.0) == []
            assert await lonely.run_group(gw, _spec(), 1, {}, 10.0) == []
            assert not gw.sessions
            return scored, gw.figures()

    scored, figures = asyncio.run(main())
    # An agent that never posts is scored by the inner environment (here: no model call, an empty sample-less
    # session) and counted; the failed ones are retried, then dropped and counted (agents/failed).
    assert figures["gateway/unrewarded/scored_by_env"] == 2
    assert figures["gateway/unrewarded/agent_failed"] == 2 and failing.failed == 1 and failing.retried == 1
    assert figures["gateway/unrewarded/timed_out"] == 1 + 2 and hanging.failed == 1 and lonely.failed == 1
    assert scored == []  # no call was made through the gateway: nothing to train on


@pytest.mark.slow
def test_a_cancelled_group_abandons_its_sessions() -> None:
    hanging = BlackBoxEnv(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=30)

    async def main():
        async with Gateway(
            FakeClient(), TOK, GatewayConfig(), temperature=1.0, top_p=1.0, max_tokens=16, seq_len=64
        ) as gw:
            from test_gateway import _spec

            run = asyncio.create_task(hanging.run_group(gw, _spec(), 2, {}, 10.0))
            while len(gw.sessions) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            for _ in range(200):  # gather returns at the first cancelled child; the other reaps its agent
                if not gw.sessions:
                    break
                await asyncio.sleep(0.01)
            return dict(gw.sessions), gw.figures()

    sessions, figures = asyncio.run(main())
    assert sessions == {} and figures["gateway/unrewarded/abandoned"] == 2


class StopClient(FakeClient):
    """Samples `text`, cut at the request's stop string as the engine cuts it (the tokens up to the one that
    completed the stop string are returned; the text ends before it)."""

    def __init__(self, text: str, pieces: list[str]) -> None:
        super().__init__()
        self.text, self.pieces = text, pieces

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, seed=None, stop=None):
        self.requests.append({"prompt": list(prompt_ids), "stop": stop})
        ids, text = [], ""
        for piece in self.pieces:  # each piece is one "token" of several bytes
            ids.append(TOK.encode(piece))
            text += piece
            if stop and any(s in text for s in stop):
                break
        cut = min(text.find(s) for s in stop if s in text) if stop and any(s in text for s in stop) else len(text)
        flat = [t for piece in ids for t in piece]
        return [
            Completion(flat, [-0.5] * len(flat), [1] * len(flat), text[:cut], "stop" if cut < len(text) else "length")
        ]


def test_stop_string_at_a_token_boundary_is_trimmed_and_the_echo_extends_token_exactly() -> None:
    client = StopClient("ab\nQ: more", ["a", "b", "\n", "Q", ":", " more"])
    with Served(client) as srv:
        srv.open("s")
        oa = _openai(srv.gw.base_url("s"))
        history = [{"role": "user", "content": "x"}]
        reply = oa.chat.completions.create(model="m", messages=history, stop=["\nQ:"])
        assert reply.choices[0].message.content == "ab"
        turn = srv.gw.sessions["s"].turns[0]
        assert TOK.decode(turn.completion_ids) == "ab"  # the stop string's tokens are not trained
        history += [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "y"}]
        oa.chat.completions.create(model="m", messages=history, stop=["\nQ:"])
        (sample,) = srv.gw.sessions["s"].trajectory.samples()  # the echo extended the first turn: one sample
        assert "\nQ:" not in TOK.decode([t for t, m in zip(sample.completion_ids, sample.completion_mask) if m])
        assert srv.gw.figures()["gateway/stop_trimmed"] == 2


def test_trim_at_stop_trims_only_exactly() -> None:
    eos = TOK.eos_token_id
    assert trim_at_stop(Completion([5, eos], [0.0, 0.0], [1, 1], "x", "stop"), TOK)[1] is None  # eos: not cut
    assert trim_at_stop(Completion([5], [0.0], [1], "x", "length"), TOK)[1] is None
    cut = Completion(TOK.encode("abc\nQ"), [-0.1] * 5, [1] * 5, "abc", "stop")
    trimmed, how = trim_at_stop(cut, TOK)
    assert how == "trimmed" and trimmed.token_ids == TOK.encode("abc") and len(trimmed.logprobs) == 3
    # No token prefix decodes to the returned text (as when the stop string starts inside a token): kept whole.
    merged = Completion([1, 2], [0.0, 0.0], [1, 1], "x", "stop")
    kept, how = trim_at_stop(merged, TOK)
    assert how == "untrimmed" and kept is merged
