"""Executes a Plan on torch.distributed: stage building, per-rank executor, split backward, training loop.

Entry points:
- `pipeplan run DIR/plan.json ...` (commands.run) starts every rank locally through torch's elastic launcher
  (`launch.launch_local`, or `launch.launch_many` for several plans of one world size in one launch);
- `python -m pipeplan.runtime.worker DIR/plan.json ...` is one rank, what launch.sh runs under torchrun;
- `trainer.Trainer` / `train.train` run inside an initialized process group (tests, benchmarks);
- `artifact.manual.manual_plan` makes a runnable plan for a hand-chosen split and schedule (no search).

Modules: stages (meta trace, fingerprint and model-file checks, materialize own stages), materialize (each rank's
tensors taken by name from a whole-model CPU build; meta path for too-large models), init_weights (--init-from
.pt / .safetensors), routing (owners, direct skip routing, message tags from the op lists), comm (early receives,
async sends), executor (F/B/I/W), grads (replica/tie/data-parallel gradient groups and divergence check),
checkpoint, watchdog (heartbeats), trace_io (measured Chrome trace), config (RunConfig, fault injection), train
(the one run loop) with its step strategies trainer.SynchronousSteps and asynchronous.AsynchronousSteps.
"""
