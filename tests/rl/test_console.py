"""The demo's console: the run (start-up lines, the progress bar, the summary), not the libraries'
records; ``jetrl_compile.console`` hides only what it names."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from jetrl_compile.console import KnownHarmless
from tests.conftest import VLLM_TINY, requires_vllm, tiny_model, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# model/recipe/engine, CPU kind and GEMM path, the output folder, the summary, the bar's own line,
# and room for a line per compiled graph or a real warning
MOST_LINES = 8
MOST_LINES_PER_STEP = 1
STEPS = 3


def _record(message: str, level=logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.worker.cpu_worker", level, __file__, 1, message, None, None)


def test_known_harmless_records_are_hidden_and_everything_else_passes():
    keep = KnownHarmless()
    assert not keep.filter(_record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
                                   "binding, skip it."))
    assert not keep.filter(_record("Failed to load /x/site-packages/torchao/_C_mxfp8.so: Could not load"))
    assert keep.filter(_record("CPU KV cache is too small for max_model_len", logging.ERROR))
    assert not keep.filter(_record("Unknown vLLM environment variable detected: VLLM_DIST_IDENT"))
    assert not keep.filter(_record("Triton is installed, but doesn't include CPU backend. Disabling Triton."))
    assert keep.filter(_record("Unknown vLLM environment variable detected: VLLM_ATTENTON_BACKEND"))  # a typo
    assert not keep.filter(_record("ParallelLMHead: Failed to load weights"))
    assert keep.filter(_record("Failed to load weights of layer 3"))  # not torchao's library, not rotary


@requires_vllm
def test_the_demo_prints_its_run_in_a_few_lines(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama", layers=2, **VLLM_TINY).save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "run"
    argv = ["--model", str(model_dir), "--steps", str(STEPS), "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--trainer-mode", "eager", "--out", str(out)]
    # as after an earlier engine in the parent: vLLM's CPU worker sets this and then warns of it
    env = {**os.environ, "VLLM_DIST_IDENT": "an_earlier_engine"}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_grpo.py"), *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
    # as a terminal shows it: the bar redraws one line (into a pipe tqdm may start each redraw anew)
    console = [line for line in re.split(r"[\r\n]+", text) if line.strip() and not line.startswith("GRPO ")]
    assert len(console) + 1 <= MOST_LINES + MOST_LINES_PER_STEP * STEPS, "\n".join(console)
    for shown in ("recipe fp8_fwd_bf16_bwd", "rollout engine vllm", "BF16 GEMM path", f"writing {out}",
                  "GRPO fp8_fwd_bf16_bwd: 100%|", "steps 1..3: reward"):
        assert shown in text, (shown, text)
    assert "INFO" not in text and "[vllm" not in text, text
    verbose = subprocess.run([sys.executable, str(ROOT / "examples" / "train_grpo.py"), *argv[:-1],
                              str(tmp_path / "verbose"), "--verbose", "--steps", "1"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env={**env, "VLLM_CONFIGURE_LOGGING": "0"})
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    # an INFO record of vLLM's, through vLLM's handler or ours (an inherited VLLM_CONFIGURE_LOGGING=0,
    # as quiet_console leaves it in the process that called it, sends vLLM's records to the root)
    assert "Resolved architecture: LlamaForCausalLM" in verbose.stdout + verbose.stderr, "--verbose shows vLLM's INFO"
