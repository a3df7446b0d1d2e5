"""GPU profiles: the memory, compute and links of the cards the planner knows, for its time model and its default
capacity. `--gpu NAME` picks one; on a GPU the planner finds its own by the name CUDA gives it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from fsdp_trainer.metrics import GiB, peak_flops


@dataclass(frozen=True)
class GPU:
    name: str
    """The --gpu name; 'generic' where only the memory is known."""
    memory_bytes: int
    """Total memory as torch reports it (total_memory), a little under the vendor's GB."""
    bf16_flops: float
    """Dense bfloat16 tensor-core peak, FLOP/s (metrics.PEAK_FLOPS, which MFU divides by too)."""
    memory_bw: float
    """Device memory bandwidth, bytes/s."""
    link: str
    """How one node's GPUs reach each other: 'NVLink 3', 'NVLink 4', 'PCIe 4', 'PCIe 5'."""
    bus_bw: float
    """NCCL bus bandwidth among one node's GPUs, bytes/s."""
    host_bw: float
    """Pinned host <-> GPU copies over the card's PCIe link, bytes/s (CPU offload)."""

    def describe(self) -> str:
        return (f"{self.name}: {self.memory_bytes / GiB:.1f} GiB, {self.bf16_flops / 1e12:.0f} TFLOP/s bf16 dense, "
                f"{self.memory_bw / 1e9:,.0f} GB/s memory, {self.link} (NCCL bus ~{self.bus_bw / 1e9:.0f} GB/s)")


NVLINK_BUS_BW = {"NVLink 3": 230e9, "NVLink 4": 350e9}
"""NCCL bus bandwidth among SXM GPUs: NVLink 4 as measured on H200s (DESIGN.md), NVLink 3 nominal."""
PCIE_BUS_BW = {"PCIe 4": 12e9, "PCIe 5": 24e9}
"""The same without NVLink, nominal: about half a x16 link's one-way rate, as the rings of 8 GPUs cross the CPUs'
root complexes."""
PCIE_HOST_BW = {"PCIe 4": 12.5e9, "PCIe 5": 25e9}
"""Pinned host <-> GPU copies as FSDP2's CPU offload makes them, one parameter at a time: half the link's peak."""


def _card(name: str, cuda_name: str, memory_gib: float, memory_gbs: float, link: str, host_link: str) -> GPU:
    bus = NVLINK_BUS_BW.get(link) or PCIE_BUS_BW[link]
    return GPU(name, int(memory_gib * GiB), peak_flops(cuda_name), memory_gbs * 1e9, link, bus,
               PCIE_HOST_BW[host_link])


# SXM cards with NVLink among the GPUs of a node; PCIe cards without bridges.
GPUS = {g.name: g for g in (
    _card("a100-40gb", "NVIDIA A100-SXM4-40GB", 39.4, 1555, "NVLink 3", "PCIe 4"),
    _card("a100-80gb", "NVIDIA A100-SXM4-80GB", 79.1, 2039, "NVLink 3", "PCIe 4"),
    _card("a6000", "NVIDIA RTX A6000", 47.5, 768, "PCIe 4", "PCIe 4"),
    _card("l40s", "NVIDIA L40S", 44.5, 864, "PCIe 4", "PCIe 4"),
    _card("h100-sxm", "NVIDIA H100 80GB HBM3", 79.1, 3350, "NVLink 4", "PCIe 5"),
    _card("h100-pcie", "NVIDIA H100 PCIe", 79.1, 2000, "PCIe 5", "PCIe 5"),
    _card("h200", "NVIDIA H200", 139.8, 4800, "NVLink 4", "PCIe 5"),
)}
REFERENCE = GPUS["h200"]
"""The card the time model's per-byte constants were measured on, whose rates a generic card gets."""

# Whole words of the CUDA device name, as metrics.PEAK_FLOPS matches them; the first match wins.
_BY_DEVICE_NAME = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A6000", "a6000"),
                   ("L40S", "l40s"))


def generic(memory_bytes: int) -> GPU:
    """A card known by its memory alone, with REFERENCE's rates."""
    return dataclasses.replace(REFERENCE, name="generic", memory_bytes=memory_bytes)


def from_device(device_name: str, memory_bytes: int) -> GPU:
    """The profile of the card CUDA calls `device_name`, with the memory it has; unknown, a generic one at the
    card's own peak where metrics.PEAK_FLOPS knows it."""
    def named(key: str) -> bool:
        return re.search(rf"\b{re.escape(key)}\b", device_name) is not None

    known = next((GPUS[name] for key, name in _BY_DEVICE_NAME if named(key)), None)
    if known is None and named("A100"):
        known = GPUS["a100-80gb" if memory_bytes > 48 * GiB else "a100-40gb"]
    if known is None:
        known = dataclasses.replace(generic(memory_bytes), bf16_flops=peak_flops(device_name)
                                    or REFERENCE.bf16_flops)
    return dataclasses.replace(known, memory_bytes=memory_bytes)


def this_gpu(index: int = 0) -> GPU:
    """The profile of this machine's CUDA device `index`."""
    return from_device(torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).total_memory)
