"""A stand-in OpenAI-compatible streaming server with known timings and faults, for
`hisparse bench serve`'s tests (a client must measure what it is sent, and count
what fails). `python -m tests.fake_openai_server --port P` binds 127.0.0.1.

The request's model name picks the behaviour: "MODE[:key=value...]", MODE one of
ok, http500, errstr (an error event that is a plain string); keys: ttft and itl
(seconds before the first chunk and between chunks), batch (tokens per chunk),
usage (0: no usage chunk). Every chunk's text is "tok" per token. GET /requests
lists the bodies received, in order.
"""

import asyncio
import json
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

app = FastAPI()
received: list[dict] = []


@app.get("/health")
async def health():
    return {"status": "ok"}


@app.get("/v1/models")
async def models():
    return {"object": "list", "data": [{"id": "ok", "object": "model"}]}


@app.get("/requests")
async def requests():
    return received


def behaviour(model: str) -> tuple[str, dict]:
    mode, *pairs = model.split(":")
    opts = {"ttft": 0.0, "itl": 0.0, "batch": 1, "usage": 1}
    for pair in pairs:
        key, value = pair.split("=")
        opts[key] = float(value)
    return mode, opts


async def completion(req: Request, chat: bool):
    body = await req.json()
    received.append(body)
    mode, o = behaviour(body.get("model", "ok"))
    n = int(body.get("max_tokens", 16))
    if mode == "http500":
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    def chunk(text, finish=None):
        choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                  else {"index": 0, "text": text, "finish_reason": finish})
        return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

    async def stream():
        await asyncio.sleep(o["ttft"])
        sent = 0
        while sent < n:
            if sent:
                await asyncio.sleep(o["itl"])
            if mode == "errstr" and sent:
                yield "data: " + json.dumps({"error": "the pool ran out"}) + "\n\n"
                return
            k = min(int(o["batch"]), n - sent)
            sent += k
            yield chunk("tok" * k, "length" if sent == n else None)
        if o["usage"]:
            yield "data: " + json.dumps({"id": "x", "choices": [], "usage": {
                "prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(req: Request):
    return await completion(req, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(req: Request):
    return await completion(req, chat=True)


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]),
                log_level="warning")
