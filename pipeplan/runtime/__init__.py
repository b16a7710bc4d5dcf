"""Executes a Plan on torch.distributed, in four subpackages (each imports only those above it in this list):

- `weights/`: the tensors: exact materialization from a whole-model build (`materialize`), `--init-from` files
  (`init_weights`), whole state_dicts written as transformers lays them out (`weights_output`), per-stage
  checkpoints (`checkpoint`);
- `step/`: one rank's step: its stages built from the plan (`stages`), who sends what to whom read off the op lists
  (`messages`), early receives and asynchronous sends (`comm`), the F/B/I/W executor (`executor`) with DualPipe's
  F&B pairs (`pair_runner`) and recomputation (`recompute_run`), gradient groups (`grads`), the optimizer step with
  ZeRO-1 (`zero`), precision at run time (`precision_run`), weight versions of asynchronous schedules
  (`async_weights`);
- `train/`: the run: `RunConfig` (`config`), the one training loop (`loop`) with its step strategies
  (`trainer.SynchronousSteps`, `asynchronous.AsynchronousSteps`; `post_validate`), the global checks before an
  update (`step_checks`), the optimizer and learning-rate schedule (`optim`), `--log` metrics (`metrics`), the
  measured trace (`trace_io`);
- `launch/`: starting ranks: the local launch (`local.launch_local`, `local.launch_many`), one rank under torchrun
  (`worker`), heartbeats (`watchdog`), what is checked before any rank starts (`prelaunch`), `run`'s options
  (`run_options`).

On top: `commands.py` (`pipeplan run`, `pipeplan export-weights`) and `export_weights.py` (a checkpoint as one
state_dict: it reads checkpoints, builds the whole model and writes weights).

Entry points:
- `pipeplan run DIR/plan.json ...` (commands.run) starts every rank locally through torch's elastic launcher;
- `python -m pipeplan.runtime.launch.worker DIR/plan.json ...` is one rank, what launch.sh runs under torchrun;
- `train.trainer.Trainer` / `train.loop.train` run inside an initialized process group (tests, benchmarks);
- `plan.manual.manual_plan` makes a runnable plan for a hand-chosen split and schedule (no search).
"""
