"""What the kernels of both dialects read: schedules, row layouts, element masks and biases, the
device helpers both call, launch sizes."""
