"""`pipeplan refine`: a plan that learns from its own run. A run's measured trace (`run --trace`) becomes per-layer
costs measured in place (`bookkeeping.py`: op -> stage -> layers, contention and all), written as a refined profile;
the run's own plan is timed again with them (it must reproduce the run) and the model is planned again from them
with the plan's settings (`replan.py`); `job.py` checks that the trace, plan and profile belong together."""
