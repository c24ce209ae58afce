"""Evaluation that gathers each rank's kept detections, or the rows a score
threshold selects (inline, or a mask made first), into buffers shaped like the local tensor: the row counts
differ across ranks."""

import os

import torch
import torch.distributed as dist
from torchvision.models.detection import fasterrcnn_resnet50_fpn
from torch.nn.parallel import DistributedDataParallel as DDP


@torch.no_grad()
def gather_detections(model, images, world_size):
    kept = []
    for out in model.module(images):
        kept.append(torch.cat([out["boxes"], out["scores"][:, None]], dim=1))
    local = torch.cat(kept)
    everyone = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)  # expect: collective-mismatch
    return torch.cat(everyone)


@torch.no_grad()
def gather_confident(scores, world_size):
    confident = scores[scores > 0.5]
    parts = [confident.clone() for _ in range(world_size)]
    dist.all_gather(parts, confident)  # expect: collective-mismatch
    return parts


@torch.no_grad()
def gather_pseudo_labels(probs, world_size, threshold=0.9):
    confidence, labels = probs.max(1)
    keep = confidence >= threshold
    kept = labels[keep]
    gathered = [torch.zeros_like(kept) for _ in range(world_size)]
    dist.all_gather(gathered, kept)  # expect: collective-mismatch
    return torch.cat(gathered)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(fasterrcnn_resnet50_fpn().cuda(local_rank), device_ids=[local_rank])
    model.eval()
    images = [torch.rand(3, 320, 320, device=f"cuda:{local_rank}")]
    dets = gather_detections(model, images, dist.get_world_size())
    gather_confident(dets[:, 4], dist.get_world_size())
    gather_pseudo_labels(dets[:, 4:].softmax(1), dist.get_world_size())
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
