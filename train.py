"""Train MobileNetV1. Every option is a Hydra override, e.g. `python train.py backend=custom amp=true`.

Data-parallel: `torchrun --nproc_per_node=N train.py ...` (NCCL on GPUs, gloo on CPU).
"""

import hydra
from hydra.core.hydra_config import HydraConfig

from mobilenet.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> float:
    from mobilenet import distributed
    from mobilenet.engine import Trainer

    hc = HydraConfig.get()
    try:
        result = Trainer(cfg, run_dir=hc.runtime.output_dir, overrides=hc.job.override_dirname).fit()
    finally:
        distributed.shutdown()
    return result.val_top1  # the value Hydra sweepers optimise


if __name__ == "__main__":
    main()
