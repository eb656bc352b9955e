"""Traits are per replica: the bytes a request is sent with depend on the replica it goes to."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tests.conftest import received
from tests.routing.conftest import PooledFactory, PoolFactory, router_of


class LlamaLike:
    """A llama.cpp-style upstream: streams report ``timings`` (in the usage chunk when asked for usage)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        usage = (body.get("stream_options") or {}).get("include_usage")
        timings = {"cache_n": 10, "prompt_n": 2, "prompt_ms": 1.0}
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}
        await resp.write(b"data: " + orjson.dumps(first) + b"\n\n")
        finish: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        if not usage:
            finish["timings"] = timings
        await resp.write(b"data: " + orjson.dumps(finish) + b"\n\n")
        if usage:
            last = {**head, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 10}}, "timings": timings}
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def test_a_llamacpp_replica_s_timings_change_only_its_own_requests(
    make_pool: PoolFactory, make_pooled: PooledFactory, aiohttp_server: Any, openai_client: Any
) -> None:
    llama = LlamaLike()
    llama_server = await aiohttp_server(llama.app())
    (sim,) = await make_pool(1)
    kvwarm = await make_pooled([str(llama_server.make_url("/v1")), sim], routing__policy="round_robin")
    client = openai_client(kvwarm)
    for n in range(6):
        stream = await client.chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": f"question {n}"}]
        )
        chunks = [c async for c in stream]
        assert chunks and all(c.usage is None for c in chunks), "the client never sees usage it did not ask for"

    assert len(llama.bodies) == 3
    # The first request to the llama.cpp replica asked for usage; after its timings, kvwarm stops.
    assert [b.get("stream_options") for b in llama.bodies] == [{"include_usage": True}, None, None]
    sim_bodies = [orjson.loads(r.body) for r in received(sim)]
    assert [b.get("stream_options") for b in sim_bodies] == [{"include_usage": True}] * 3
    llama_replica, sim_replica = router_of(kvwarm).replicas
    assert llama_replica.traits.reports_timings and not sim_replica.traits.reports_timings
