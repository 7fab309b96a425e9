"""Attention kernels: metadata and the torch reference, the CPU C kernel, the Triton GPU kernels."""
