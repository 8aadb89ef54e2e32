"""Triton kernels: schedules, forward, backward, tile configs."""
