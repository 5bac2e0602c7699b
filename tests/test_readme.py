"""The README's API example runs as printed, on a tiny random model and a word-level tokenizer."""

import re
from pathlib import Path

import torch

from tests.conftest import VLLM_TINY, requires_vllm, tiny_model, word_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def _api_example() -> str:
    section = README.read_text().split("## The API in 15 lines", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    return code


def test_the_api_example_is_at_most_15_lines():
    assert len(_api_example().strip().splitlines()) <= 15


@requires_vllm
def test_the_readme_api_example_runs_and_trains(capsys):
    model = tiny_model("llama", layers=2, **VLLM_TINY)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    namespace = {"model": model, "tokenizer": word_tokenizer()}
    try:
        exec(compile(_api_example(), str(README), "exec"), namespace)
    finally:
        if "engine" in namespace:
            namespace["engine"].close()
    assert not torch.equal(before, namespace["model"].model.layers[0].mlp.up_proj.weight)  # the step changed it
    out = capsys.readouterr().out
    assert "mismatch_kl" in out and "'fprop': 'fp8'" in out


def test_the_drivers_help_quotes_the_readmes_demo_times():
    """train_grpo.py's usage says how long the demo takes: the range of the README's table."""
    driver = (README.parent / "examples" / "train_grpo.py").read_text()
    low, high = map(int, re.search(r"arithmetic: (\d+)-(\d+) min on 2 CPU cores", driver).groups())
    table = README.read_text().split("`make demo` wall", 1)[1].split("\n\n", 1)[0]
    minutes = [float(m) for m in re.findall(r"\| (\d+\.\d) min", table)]
    assert len(minutes) >= 3 and (low, high) == (int(min(minutes)), -int(-max(minutes) // 1)), (minutes, low, high)
