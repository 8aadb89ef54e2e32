"""The kernel backends, each in a folder of its own with its tile configs: triton (every CUDA GPU,
sm80+) and gluon_sm90 (warp-specialised Hopper kernels)."""
