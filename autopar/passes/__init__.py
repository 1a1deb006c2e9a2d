"""Compiler passes over torch.fx graphs: capture, shape/FLOP annotation, rewrite."""
