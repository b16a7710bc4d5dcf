"""The search over layouts (tensor parallel size x pipeline depth x data-parallel pipelines x microbatches x schedule,
recomputation, ZeRO): candidates evaluated with the partitioner and the simulator, the choice and its rationale, and
the `plan` command that writes the winner as a Plan."""
