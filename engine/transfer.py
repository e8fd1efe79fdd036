"""Host lists to device tensors without making the host wait for the GPU.

A host-to-device copy from ordinary (pageable) memory waits for all the GPU work queued before it, which would stall
async scheduling (the host prepares step t + 1 while step t runs); a copy from pinned memory is queued like a kernel.
"""

import torch


def to_device(values, dtype, device) -> torch.Tensor:
    on_cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=on_cuda).to(device, non_blocking=True)
