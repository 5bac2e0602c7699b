"""What every rank of a multi-process test would otherwise load for itself, done once in the fork
server that ``conftest.run_ranks`` forks the ranks from: the package, vLLM (about 4 s to import)
and its plugin where installed, Inductor with its CPU vector-ISA probe (compiler runs, about 1 s,
cached in-process), and matplotlib for the driver's plot. Then the loaded objects are frozen out
of the garbage collector's reach: vLLM collects garbage several times while an engine starts and
stops, and each collection walked the whole heap of these imports again (about 1 s a run).

It imports and probes only, and checks that no Python thread started: a compile here would leave
one behind (tqdm's monitor), and forking a process while another thread runs Python is unsafe.
Importing torch and numpy also starts native threads (probably BLAS pools; torch alone starts
one). The fork server had torch's since it was introduced, and its ranks have forked cleanly."""

import gc
import threading

import torch.distributed.fsdp  # noqa: F401
import transformers  # noqa: F401
from torch._inductor.cpu_vec_isa import pick_vec_isa

import jetrl_compile.passes.regions  # noqa: F401
import jetrl_compile.rl.loop  # noqa: F401
import tests.conftest  # noqa: F401

try:  # optional extras: without them the ranks load what they need themselves
    import matplotlib.pyplot  # noqa: F401
    import vllm.entrypoints.llm  # noqa: F401

    import jetrl_compile.rollout.vllm_plugin  # noqa: F401
except ImportError:
    pass

pick_vec_isa()
assert threading.active_count() == 1, f"the fork server started threads: {threading.enumerate()}"
gc.freeze()
