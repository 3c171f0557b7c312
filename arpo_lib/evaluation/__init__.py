"""Measuring a policy: evaluation (success, pass@k, steps, format errors) and ARPO's task selection."""
