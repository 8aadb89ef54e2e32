"""What runs a planned call on the GPU: launches past Triton's binder, call plans replayed per
signature, and the switches and device facts every layer reads."""
