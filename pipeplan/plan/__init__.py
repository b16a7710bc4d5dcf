"""The plan artifact: `Plan` (plan.json) and what is read off it — its layout and rank map, its timing again (`show`,
timeline.json, `run`'s prediction), the launch scripts, the summary, a hand-chosen plan (`manual_plan`), and the
`show` / `export` commands. The runtime imports this room and nothing of the search."""
