"""Top-1 and top-5 accuracy over a whole validation loader, with its throughput."""

from __future__ import annotations

import torch
from torch import nn

from .meter import StepMeter, Throughput


def _sum_over_process_group(correct1: torch.Tensor, correct5: torch.Tensor, seen: int, device: torch.device):
    """Every rank's counts added up, so that each rank reports the accuracy over the whole validation set."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return correct1, correct5, seen
    totals = torch.stack([correct1, correct5, torch.tensor(seen, device=device)])
    torch.distributed.all_reduce(totals)
    return totals[0], totals[1], int(totals[2])


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp_dtype: torch.dtype | None,
             warmup_steps: int = 0) -> tuple[float, float, int, Throughput]:
    """(top1 %, top5 %, images, throughput) over the whole loader; every image counted exactly once."""
    was_training = model.training
    model.eval()
    correct1 = torch.zeros((), dtype=torch.int64, device=device)
    correct5 = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    meter = StepMeter(device, warmup_steps)
    it = iter(loader)
    while True:
        meter.data_start()
        try:
            images, labels = next(it)
        except StopIteration:
            break
        meter.compute_start()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(labels.view(-1, 1))
        correct1 += hit[:, 0].sum()
        correct5 += hit.any(dim=1).sum()
        seen += labels.shape[0]
        meter.step_end(labels.shape[0])
    model.train(was_training)
    correct1, correct5, seen = _sum_over_process_group(correct1, correct5, seen, device)
    if seen == 0:
        raise RuntimeError("validation loader yielded no images")
    return 100.0 * int(correct1) / seen, 100.0 * int(correct5) / seen, seen, meter.result()
