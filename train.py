"""Train MobileNetV1. Every option is a Hydra override, e.g. `python train.py backend=custom amp=true`.

Data-parallel: `torchrun --nproc_per_node=N train.py ...` (NCCL on GPUs, gloo on CPU).
A mistake in the command, config or data prints one `error: ...` line; `--debug` (or HYDRA_FULL_ERROR=1) shows the
traceback as well.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig

from mobilenet.config import register_configs
from mobilenet.errors import DEBUG_ENV, report_user_errors

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    trainer = None

    def discard_if_unused(_exc: BaseException) -> None:
        from mobilenet.engine import discard_run_dir

        if (trainer is None or trainer.global_step == trainer.start_step) and discard_run_dir(run_dir):
            print(f"removed the run directory {run_dir}: the run stopped before its first step", flush=True)

    with report_user_errors(cleanup=discard_if_unused):
        from mobilenet import distributed
        from mobilenet.config import check_config
        from mobilenet.engine import Trainer

        is_main = int(os.environ.get("RANK", "0")) == 0
        if is_main:
            print(f"run directory: {run_dir}", flush=True)
        check_config(cfg)
        try:
            trainer = Trainer(cfg, run_dir=run_dir, overrides=hc.job.override_dirname)
            result = trainer.fit()
        finally:
            distributed.shutdown()
        if is_main:
            hint = " (resume=RUN_DIR continues it)" if cfg.save_checkpoints else ""
            print(f"run directory: {run_dir}{hint}", flush=True)
    return result.val_top1  # the value Hydra sweepers optimise


def check_command_line(argv: list[str]) -> None:
    """A single run's overrides are composed before Hydra starts, so that a bad one is one `error:` line. Sweeps
    (-m) and Hydra's own flags go to Hydra as they are."""
    from mobilenet.config import check_overrides
    from mobilenet.errors import debug_requested

    if debug_requested() or any(a.startswith("-") for a in argv[1:]):
        return
    with report_user_errors():
        check_overrides(argv[1:])


def take_debug_flag(argv: list[str]) -> list[str]:
    """--debug is this script's, not Hydra's: it asks for full tracebacks, as HYDRA_FULL_ERROR=1 does."""
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [a for a in argv if a != "--debug"]
    return argv


if __name__ == "__main__":
    sys.argv = take_debug_flag(sys.argv)
    check_command_line(sys.argv)
    main()
