"""Training of feature heads (EAGLE family) for a target: the data (self-distillation) and the loop."""
