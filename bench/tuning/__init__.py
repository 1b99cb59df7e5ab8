"""Trace-driven simulator of the speculation tuner (see ``bench/tuning_sim.py``)."""
