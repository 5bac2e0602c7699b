"""jetrl-serve: an export served over vLLM's OpenAI-compatible HTTP API answers with the
in-process engine's tokens and logprobs; a broken export is refused before vLLM starts."""

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from jetrl_compile.rollout import _vllm_compat, serve
from jetrl_compile.rollout.engines import CPU_KV_CACHE_GIB, MAX_MODEL_LEN, VllmEngine
from jetrl_compile.rollout.export import export_vllm
from tests.conftest import free_port, requires_vllm, unified_tiny, word_tokenizer

SERVE = Path(sys.executable).parent / "jetrl-serve"  # the console script `make venv` installs


def test_serve_refuses_a_broken_export_before_vllm_starts(tmp_path):
    done = subprocess.run([str(SERVE), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "is not a jetrl_compile export" in done.stderr
    assert subprocess.run([str(SERVE)], capture_output=True, text=True, timeout=60).returncode == 2


def test_on_the_cpu_serve_starts_the_drivers_engine_unless_told_otherwise(tmp_path):
    """The CPU defaults: eager, the export's context capped as VllmEngine caps it, the driver's KV
    cache; each flag or variable the user gives wins, in any of the spellings vLLM reads."""
    export = tmp_path / "ckpt"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    flags, env = serve.cpu_defaults(str(export), ["--port", "8000"], {})
    assert flags == ["--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN)] and MAX_MODEL_LEN == 2048
    assert env == {"VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_CACHE_GIB)}
    (export / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert serve.cpu_defaults(str(export), [], {})[0] == ["--enforce-eager", "--max-model-len", "512"]
    flags, env = serve.cpu_defaults(str(export), ["--no-enforce-eager", "--max_model_len=128"],
                                    {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert flags == [] and env == {}
    assert serve.cpu_defaults(str(export), ["--enforce-eager", "--max-model-len", "64"], {})[0] == []


@requires_vllm
def test_cli_version_lookup_answers_for_the_cpu_wheel():
    try:
        importlib.metadata.version("vllm")
        pytest.skip("the `vllm` distribution itself is installed: its command line needs no help")
    except importlib.metadata.PackageNotFoundError:
        pass
    with _vllm_compat.cli_version_known():
        assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("no-such-distribution")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def _server(path: Path, workdir: Path):
    port, log = free_port(), workdir / "serve.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}
    command = [str(SERVE), str(path), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "128", "--enforce-eager", "--logprobs-mode", "raw_logprobs"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"jetrl-serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"jetrl-serve not healthy after 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.slow
@requires_vllm
def test_served_export_answers_with_the_in_process_engines_logprobs(tmp_path):
    model, tokenizer = unified_tiny(), word_tokenizer()
    path = export_vllm(model, tmp_path / "ckpt", tokenizer=tokenizer)
    prompt, seed = [5, 6, 7], 7
    engine = VllmEngine(model, tokenizer=tokenizer, workdir=tmp_path / "engine", max_model_len=128)
    try:
        expected = engine.generate([prompt], n=2, max_new_tokens=4, seed=seed)[0]
    finally:
        engine.close()

    with _server(path, tmp_path) as api:
        completion = _post(f"{api}/completions", dict(
            model=str(path), prompt=prompt, n=2, max_tokens=4, seed=seed, temperature=1.0, logprobs=0,
            return_tokens_as_token_ids=True))
        chat = _post(f"{api}/chat/completions", dict(
            model=str(path), messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=4, seed=seed,
            temperature=1.0, logprobs=True))

    choices = sorted(completion["choices"], key=lambda c: c["index"])
    for want, got in zip(expected, choices):
        assert [int(t.removeprefix("token_id:")) for t in got["logprobs"]["tokens"]] == want.token_ids
        assert got["logprobs"]["token_logprobs"] == want.logprobs  # bitwise: JSON floats round-trip
    # the chat template renders the same prompt tokens, so the first sample is the same
    assert [t["logprob"] for t in chat["choices"][0]["logprobs"]["content"]] == expected[0].logprobs
