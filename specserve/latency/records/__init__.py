"""What the model is fitted from: `specserve bench` run records, their per-request rows, and which runs are past
saturation (excluded from every fit)."""
