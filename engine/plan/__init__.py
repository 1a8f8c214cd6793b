"""Choosing bit widths: calibration statistics, sensitivity in output KL, the planner."""
