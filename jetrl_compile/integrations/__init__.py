"""Hosts: other RL trainers running on the unified flow. Each module imports its host library
(an optional extra), so importing this package loads none of them.

- ``jetrl_compile.integrations.trl``: TRL's ``GRPOTrainer`` (``pip install jetrl-compile[trl]``).
"""
