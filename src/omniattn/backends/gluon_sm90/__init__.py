"""The warp-specialised Gluon kernels of Hopper (sm90): forward, backward, the head-dim-256
backward, the pieces they share and their tile configs."""
