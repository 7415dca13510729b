#!/usr/bin/env python3
"""Real clients against `kiln serve`: the `openai` Python package and curl.

Starts `kiln serve` (the embedded model on the CPU) on a free loopback port, speaks to it
as applications do (chat and completions, streamed and not, n > 1, stop strings, errors),
then stops it with SIGTERM and requires exit status 0.

    python3 scripts/serve/clients.py [path/to/kiln]   (default: target/debug/kiln)
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai

KEY = "ci-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kiln, port):
    proc = subprocess.Popen(
        [kiln, "serve", "--device", "cpu", "--port", str(port), "--api-key", KEY, "-t", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kiln serve exited early: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("kiln serve did not become healthy in 60 s")


def curl(*args):
    out = subprocess.run(["curl", "-sS", *args], check=True, capture_output=True, text=True)
    return out.stdout


def main():
    kiln = sys.argv[1] if len(sys.argv) > 1 else "target/debug/kiln"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(kiln, port)
    passed = 0
    failed = []

    def check(name, fn):
        nonlocal passed
        try:
            fn()
            passed += 1
            print(f"ok   {name}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            failed.append(name)
            print(f"FAIL {name}: {e!r}")

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = "Permission is hereby granted, free of charge,"

    def completions():
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length"), r
        assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0, r.usage
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    def completions_stream():
        whole = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        ).choices[0].text
        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole, (text, whole)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16, chunks[-1]

    def chat():
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "You write licenses."},
                      {"role": "user", "content": "Write one."}],
            max_tokens=12, temperature=0,
        )
        assert r.choices[0].message.role == "assistant", r
        assert isinstance(r.choices[0].message.content, str)

    def chat_stream():
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] in ("stop", "length"), finishes

    def n_choices():
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, n=3, seed=1,
            temperature=1.0,
        )
        assert sorted(c.index for c in r.choices) == [0, 1, 2], r

    def stop_strings():
        full = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        ).choices[0].text
        stop = full[5:8]
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop", r
        assert stop not in r.choices[0].text and full.startswith(r.choices[0].text), (r, full, stop)

    def errors():
        try:
            client.completions.create(model=model, prompt=prompt, temperature=-1)
            raise AssertionError("a negative temperature was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "temperature", e.body
        try:
            client.completions.create(model="no-such-model", prompt=prompt)
            raise AssertionError("an unknown model was accepted")
        except openai.NotFoundError:
            pass
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass

    def with_curl():
        auth = ["-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json"]
        r = json.loads(curl(*auth, "-d", json.dumps({"prompt": prompt, "max_tokens": 4}), f"{base}/v1/completions"))
        assert r["object"] == "text_completion", r
        sse = curl("-N", *auth, "-d", json.dumps({"prompt": prompt, "max_tokens": 4, "stream": True}),
                   f"{base}/v1/completions")
        lines = [l for l in sse.splitlines() if l.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", sse
        code = curl("-o", "/dev/null", "-w", "%{http_code}", *auth, "-d", "{bad json", f"{base}/v1/completions")
        assert code == "400", code
        assert curl("-o", "/dev/null", "-w", "%{http_code}", f"{base}/health") == "200"
        assert "kiln_generation_tokens_total" in curl(f"{base}/metrics")

    for name, fn in [
        ("completions", completions),
        ("completions, streamed, with usage", completions_stream),
        ("chat", chat),
        ("chat, streamed", chat_stream),
        ("n > 1", n_choices),
        ("stop strings", stop_strings),
        ("errors", errors),
        ("curl", with_curl),
    ]:
        check(name, fn)

    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "a hang"
    if code == 0:
        passed += 1
        print("ok   SIGTERM: exit 0")
    else:
        failed.append("SIGTERM")
        print(f"FAIL SIGTERM: exit {code}; stderr: {proc.stderr.read()}")
    print(f"{passed} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
