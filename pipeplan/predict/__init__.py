"""Prediction: one pipeline's step from its layout, op lists and costs — `predict(StepInputs) -> Prediction` (its
period, bubble, per-device peak bytes), the one call the search's candidates and a plan's re-simulation make.
Here too: where stages and ops land (`layout`), the period model (`step`), the gradient exchange and optimizer update
of each stage (`gradient_sync`) and the static-bytes rule (`memory`). It stands on schedules, costs and the
partition's result; nothing here knows the search or the plan artifact."""
