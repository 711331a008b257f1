"""Shim of nanochat.common: what gpt.py imports from it. nanochat computes in float32 on CPU
(COMPUTE_DTYPE's auto-detection without CUDA)."""

import torch

COMPUTE_DTYPE = torch.float32


def get_dist_info():
    return False, 0, 0, 1


def print0(*args, **kwargs):
    pass
