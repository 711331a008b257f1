"""Shim of nanochat.common: what gpt.py and engine.py import from it. nanochat computes in
float32 on CPU (COMPUTE_DTYPE's auto-detection without CUDA)."""

import torch

COMPUTE_DTYPE = torch.float32


def get_dist_info():
    return False, 0, 0, 1


def print0(*args, **kwargs):
    pass


def autodetect_device_type():
    return "cpu"  # the tests run the references on the CPU


def compute_init(device_type="cpu"):
    # not distributed: ddp, ddp_rank, ddp_local_rank, ddp_world_size, device
    return False, 0, 0, 1, torch.device(device_type)
