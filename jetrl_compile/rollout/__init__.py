"""The rollout side: what the engine gets from the trainer (``export``), our vLLM quantization
method (``vllm_plugin``), the engines (``engines``) and every reach into vLLM internals
(``_vllm_compat``). Imports nothing of ``passes`` or ``rl``."""
