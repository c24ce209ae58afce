"""Every rank loads the teacher checkpoint onto the CPU (map_location) and
strips its "module." prefixes before loading it, then moves the teacher to
its own GPU: no rank touches another's device."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP


def build_teacher(path, device):
    teacher = torchvision.models.resnet50(num_classes=100)
    checkpoint = torch.load(path, map_location="cpu")
    state = {k.removeprefix("module."): v for k, v in checkpoint["model"].items()}
    teacher.load_state_dict(state)
    return teacher.to(device).eval()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    teacher = build_teacher("teacher.pt", device)
    student = DDP(torchvision.models.resnet18(num_classes=100).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    for step in range(100):
        images = torch.randn(64, 3, 224, 224, device=device)
        with torch.no_grad():
            target = F.softmax(teacher(images) / 4.0, dim=-1)
        loss = F.kl_div(F.log_softmax(student(images) / 4.0, dim=-1), target, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del student  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
