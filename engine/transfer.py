"""Host lists to device tensors without making the host wait for the GPU.

A host-to-device copy from ordinary (pageable) memory waits for all the GPU work queued before it, which would stall
async scheduling (the host prepares step t + 1 while step t runs); a copy from pinned memory is queued like a kernel.
"""

import torch


def to_device(values, dtype, device) -> torch.Tensor:
    on_cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=True)


def host_tensor_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device, through pinned memory on CUDA (a small host copy) so that the copy is queued
    like a kernel instead of waiting for the GPU."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":  # already there (a device-side input)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
