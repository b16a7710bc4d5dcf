"""The plan artifact: `Plan` (plan.json) and what is read off it — its rank map (`ranks`), the inputs its step was
predicted from (`timing`: `show`, timeline.json and `run`'s prediction call `predict.predict` again), the launch
scripts, the summary, the engine exports, a hand-chosen plan (`manual_plan`), and the `show` / `export` commands. The
runtime imports this room and nothing of the search. (Named `artifact`, not `plan`: `pipeplan.plan` is the API's
function.)"""
