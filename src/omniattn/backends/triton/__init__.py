"""The Triton kernels: forward, backward and their tile configs."""
