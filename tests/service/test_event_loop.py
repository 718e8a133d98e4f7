"""Item 2: one huge request must not freeze the server (length checks first, work off the loop).

Before the fix a 10 MB prompt held the event loop 12-28 s and 100k messages 5-6 s; the bound
on /health latency leaves room for two shared CPU cores. Which check refused is read from the
error message (the cheap length checks name characters or message counts), not from the wall
time of the request, which on a shared CI machine measures the machine as much as the server.
Bodies are encoded before the clock starts so the client's JSON work is not counted.
"""

from __future__ import annotations

import threading
import time

import httpx
import msgspec

from tests.support.whole_app import MODEL, App


def _health_latencies(app: App, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=app.url, timeout=60) as h:
        while not stop.is_set():
            t0 = time.monotonic()
            assert h.get("/health").status_code == 200
            out.append(time.monotonic() - t0)
            time.sleep(0.01)


def _while_polling_health(app: App, send: object) -> tuple[httpx.Response, float]:
    stop = threading.Event()
    latencies: list[float] = []
    poller = threading.Thread(target=_health_latencies, args=(app, stop, latencies))
    poller.start()
    time.sleep(0.1)
    try:
        r = send()  # type: ignore[operator]
    finally:
        stop.set()
        poller.join()
    return r, max(latencies)


def test_a_10mb_prompt_is_refused_at_once_and_health_keeps_answering(app: App) -> None:
    prompt = "lorem ipsum dolor sit amet " * 360_000  # ~9.7 MB, under the 10 MB body limit
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    with app.http() as h:
        r, worst = _while_polling_health(
            app,
            lambda: h.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    # Refused by the character count, before the tokenizer saw the text.
    assert f"the prompt has {len(prompt)} characters" in error["message"], error
    assert worst < 2.0, worst


def test_100k_chat_messages_are_refused_before_template_work(app: App) -> None:
    messages = [{"role": "user", "content": "hi"}] * 100_000
    body = msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 1})
    with app.http() as h:
        r, worst = _while_polling_health(
            app,
            lambda: h.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            ),
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages"
    # Refused by the message count, before any template rendering.
    assert "the conversation has 100000 messages" in error["message"], error
    assert worst < 2.0, worst


def test_long_text_under_the_bound_is_tokenized_off_the_loop(app: App) -> None:
    # Just under the cheap bound: it must be tokenized to know, in a worker thread.
    bound = app.serving.options.max_input_len * app.serving.tokenizer.max_token_chars * 2
    prompt = ("a" * 7 + " ") * (bound // 8)
    with app.http() as h:
        r, worst = _while_polling_health(
            app, lambda: h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert worst < 2.0, worst
