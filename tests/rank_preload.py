"""What every rank of a multi-process test would otherwise load for itself, done once in the fork
server that ``conftest.run_ranks`` forks the ranks from: the package, vLLM (about 4 s to import)
and its plugin where installed, Inductor with its CPU vector-ISA probe (compiler runs, about 1 s,
cached in-process), matplotlib for the driver's plot, and the fused FP8 quantize compiled for the
tiny models' linear widths (about 0.5 s a graph, which every rank of every run compiled again).
Then the loaded objects are frozen out of the garbage collector's reach: vLLM collects garbage
several times while an engine starts and stops, and each collection walked the whole heap of these
imports again (about 1 s a run).

It checks that no Python thread started, as forking a process while another thread runs Python is
unsafe: compiling here would leave tqdm's monitor thread behind, so tqdm runs without it (in the
ranks too). Importing torch and numpy also starts native threads (probably BLAS pools; torch alone
starts one). The fork server had torch's since it was introduced, and its ranks have forked
cleanly; the compiles here run on one thread, so no OpenMP pool is forked."""

import gc
import threading

import torch
import torch.distributed.fsdp  # noqa: F401
import transformers  # noqa: F401
from torch._inductor.cpu_vec_isa import pick_vec_isa

import jetrl_compile.passes.regions  # noqa: F401
import jetrl_compile.rl.loop  # noqa: F401
from tests.conftest import FSDP_ALIGNED, VLLM_TINY, tiny_config

try:  # optional extras: without them the ranks load what they need themselves
    import matplotlib.pyplot  # noqa: F401
    import vllm.entrypoints.llm  # noqa: F401

    import jetrl_compile.rollout.vllm_plugin  # noqa: F401
except ImportError:
    pass


def _linear_widths(**dims) -> set[int]:
    """A tiny model's linear in- and out-features."""
    config = tiny_config(**dims)
    return {config.hidden_size, config.intermediate_size,
            config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)}


def _warm_fused_quantize():
    """The fused FP8 quantize's graphs for the tiny models' widths, as the ranks call it (on one
    thread): a rank that finds its width here compiles nothing, one that does not compiles it, as
    before; the results are the same either way.
    Measured with the 2-process test files alone: 114-120 s without, 93-95 s with."""
    import tqdm
    from torch._inductor import config as inductor_config

    from jetrl_compile.runtime.kernels import gemm_operand_dtype
    from jetrl_compile.runtime.quantize import fake_quantize_groupwise, fused_quantize_groupwise

    tqdm.tqdm.monitor_interval = 0  # Inductor's progress bar (disabled) starts tqdm's monitor otherwise
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' count (Dynamo guards on it); no OpenMP pool to fork
    with inductor_config.patch(compile_threads=1):  # no compile workers
        widths = _linear_widths() | _linear_widths(**VLLM_TINY) | _linear_widths(**FSDP_ALIGNED)
        tensor_parallel = {FSDP_ALIGNED["hidden_size"] // 2, FSDP_ALIGNED["intermediate_size"] // 2}  # row shards
        operand = gemm_operand_dtype("cpu")  # what the emulated FP8 GEMM multiplies in here
        # Dynamo guards on grad mode and on inference tensors: the trainer's linears quantize
        # without grad (inside their autograd function), vLLM's under inference mode. Constant
        # inputs: the ranks inherit this process's random state.
        for context in (torch.no_grad, torch.inference_mode):
            with context():
                for width in sorted(widths | tensor_parallel):
                    fake_quantize_groupwise(torch.ones(3, width, dtype=torch.bfloat16), operand)
        with torch.no_grad():
            for tokens in (24, 160):  # the FP8 wgrad's x^T and dy^T: under 128 tokens, and a tail
                fused_quantize_groupwise(torch.ones(tokens, 64, dtype=torch.bfloat16).t(), along_tokens=True)
    torch.set_num_threads(threads)


pick_vec_isa()
_warm_fused_quantize()
assert threading.active_count() == 1, f"the fork server started threads: {threading.enumerate()}"
gc.freeze()
