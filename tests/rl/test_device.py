"""The driver on a GPU (``--device``, ``--vllm-memory``): what can be checked without one. The
device is resolved and refused where torch sees no GPU, ranks pick NCCL on GPUs and gloo on the
CPU, and vLLM is given the stated share of the GPU's memory (a real GPU run: ``bench/gpu.sh``)."""

import pytest
import torch

from jetrl_compile.errors import UsageValueError
from jetrl_compile.rl import parallel
from jetrl_compile.rl.config import GrpoConfig
from jetrl_compile.rollout.engines import memory_share


def test_auto_is_the_gpu_where_torch_sees_one_and_the_cpu_elsewhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GrpoConfig().resolved_device() == "cpu"
    assert GrpoConfig(device="cpu").resolved_device() == "cpu"
    with pytest.raises(UsageValueError, match=r"--device cuda: this torch sees no CUDA GPU"):
        GrpoConfig(device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert GrpoConfig().resolved_device() == "cuda"
    assert GrpoConfig(device="cpu").resolved_device() == "cpu"


def test_ranks_talk_nccl_between_gpus_and_gloo_on_the_cpu():
    assert parallel.backend_for("cuda:1") == "nccl" and parallel.backend_for("cuda") == "nccl"
    assert parallel.backend_for("cpu") == "gloo"
    one = parallel.start("none", batch_size=4, device="cpu")
    assert (one.device, one.distributed, one.total(3.0)) == ("cpu", False, 3.0)


def test_a_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    assert parallel._own_device("cuda", local_rank=0) == "cuda:0"
    with pytest.raises(UsageValueError, match="local rank 1 has no GPU of its own: this machine has 1"):
        parallel._own_device("cuda", local_rank=1)


def test_vllm_gets_the_stated_share_of_the_gpus_memory_and_none_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert memory_share(0.3) == {"gpu_memory_utilization": 0.3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_share(0.3) == {}
    with pytest.raises(ValueError, match="gpu_memory=0 is a share of the GPU's memory"):
        memory_share(0)
