"""``python -m specter.serve``: the README command on a fresh process, greedy text equal to
``python -m specter.run``'s for the same prompt, the API key and chat template options, Ctrl-C;
mistakes exit with code 2 and one line before anything loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from serve_support import CHAT_MESSAGES, CHAT_TEMPLATE, RECIPE, ROOT, http

from specter.serve.__main__ import main


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["no/such/recipe.yaml"], "error: "),
    ([str(RECIPE), "--set", "no_such_key=1"], "no_such_key"),
    ([str(RECIPE), "--queue-depth", "-1"], "--queue-depth"),
    ([str(RECIPE), "--chat-template", "no/such/template.jinja"], "--chat-template"),
])
def test_mistakes_exit_2_with_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_a_template_that_is_not_jinja_and_an_empty_api_key_exit_2_before_loading(tmp_path, monkeypatch, capsys):
    import specter.api

    monkeypatch.setattr(specter.api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    assert main([str(RECIPE), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --chat-template: {template}: line 2: ")
    assert main([str(RECIPE), "--api-key", ""]) == 2  # e.g. --api-key "$UNSET": not silently keyless
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --api-key: empty")
    monkeypatch.setenv("SPECTER_API_KEY", "")  # an empty variable is an unset one: no key, no error
    monkeypatch.setattr(specter.api, "load", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert main([str(RECIPE)]) == 130


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
def test_a_port_outside_1_to_65535_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(RECIPE), "--port", port])
    assert info.value.code == 2 and "argument --port: " in capsys.readouterr().err


def test_a_port_in_use_exits_2_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main([str(RECIPE), "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen" in capsys.readouterr().err


def test_the_readme_command_serves_the_same_greedy_text_as_specter_run(tmp_path, monkeypatch, capsys):
    port, key = free_port(), "test-key"
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    env = {k: v for k, v in os.environ.items() if k != "SPECTER_API_KEY"}
    server = subprocess.Popen(
        [sys.executable, "-m", "specter.serve", "recipes/quickstart.yaml", "--port", str(port), "--api-key", key,
         "--chat-template", str(template), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # meanwhile, the same recipe through specter.run (in this process) for its first prompt
        from specter.run import main as run_main

        monkeypatch.chdir(ROOT)
        report_path = tmp_path / "r.json"
        assert run_main(["recipes/quickstart.yaml", "--set", "max_prompts=1", "--report", str(report_path),
                         "--quiet"]) == 0
        capsys.readouterr()
        output = json.loads(report_path.read_text())["outputs"][0]
        prompt = json.loads((ROOT / "recipes/prompts/eval.jsonl").read_text().splitlines()[0])["prompt"]

        deadline = time.time() + 90
        while not (_up(port) and http("GET", f"http://127.0.0.1:{port}/health")[0] == 200):
            assert server.poll() is None, server.stdout.read()
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        response = client.completions.create(model="bundled:tiny-moe", prompt=prompt, max_tokens=48, temperature=0)
        assert response.usage.completion_tokens == len(output["token_ids"])
        # the same tokens; specter.run also prints the end-of-sequence token's text, the server does not
        assert response.choices[0].text == output["text"].removesuffix("<|endoftext|>")
        chat = client.chat.completions.create(model="bundled:tiny-moe", messages=CHAT_MESSAGES, max_tokens=4)
        assert chat.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        server.send_signal(signal.SIGINT)
        assert server.wait(20) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _up(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
