"""Learning without Forgetting (LwF), task-incremental Split Tiny-ImageNet.

One shared ResNet-18 backbone and one linear head per task. While training
task t the student is distilled on heads 0..t-1 towards a frozen copy of the
model taken at the end of task t-1.

    torchrun --nproc_per_node=8 02_lwf_multihead_tasks.py --data /data/tiny-imagenet-200
"""
import argparse
import copy
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

log = logging.getLogger("lwf")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/tiny-imagenet-200")
    ap.add_argument("--out", default="checkpoints/lwf_tiny")
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--lwf-lambda", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default="", help="checkpoint written at the end of a task")
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


class MultiHeadNet(nn.Module):
    def __init__(self, n_tasks, classes_per_task):
        super().__init__()
        backbone = torchvision.models.resnet18(weights=None)
        backbone.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        backbone.maxpool = nn.Identity()
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.heads = nn.ModuleList(nn.Linear(512, classes_per_task) for _ in range(n_tasks))

    def forward(self, x, task_ids):
        feats = self.backbone(x)
        return [self.heads[t](feats) for t in task_ids]


def kd_loss(student_logits, teacher_logits, T):
    log_p = F.log_softmax(student_logits / T, dim=1)
    q = F.softmax(teacher_logits / T, dim=1)
    return F.kl_div(log_p, q, reduction="batchmean") * T * T


def split_by_task(dataset, n_tasks):
    targets = np.array(dataset.targets)
    n_cls = len(dataset.classes)
    per = n_cls // n_tasks
    out = []
    for t in range(n_tasks):
        idx = np.where((targets >= t * per) & (targets < (t + 1) * per))[0]
        out.append(Subset(dataset, idx))
    return out, per


@torch.no_grad()
def evaluate_task(net, subset, task_id, per, device, rank, world):
    """Task-IL accuracy of one task; each rank scores a disjoint strided shard."""
    net.eval()
    shard = Subset(subset, list(range(rank, len(subset), world)))
    loader = DataLoader(shard, batch_size=200, num_workers=4, pin_memory=True)
    counts = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = net(x, [task_id])[0]
        counts[0] += (out.argmax(1) == (y - task_id * per)).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1]).item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    norm = transforms.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282))
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomCrop(64, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm]))
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"),
                                              transforms.Compose([transforms.ToTensor(), norm]))
    train_tasks, per = split_by_task(train_ds, args.tasks)
    val_tasks, _ = split_by_task(val_ds, args.tasks)

    net = MultiHeadNet(args.tasks, per).to(device)
    acc = torch.zeros(args.tasks, args.tasks)
    start_task = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        acc = ckpt["acc"]
        start_task = ckpt["task"] + 1
        log.info("resumed from %s, starting at task %d", args.resume, start_task)

    # only the heads of tasks <= t take part in a step, the others get no grad
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    per_gpu_batch = args.global_batch // world
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    teacher = None
    if start_task > 0:
        teacher = copy.deepcopy(net).eval().requires_grad_(False)

    for t in range(start_task, args.tasks):
        sampler = DistributedSampler(train_tasks[t], shuffle=True)
        loader = DataLoader(train_tasks[t], batch_size=per_gpu_batch, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True,
                            persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
        sched = torch.optim.lr_scheduler.MultiStepLR(
            opt, milestones=[int(args.epochs * 0.5), int(args.epochs * 0.75)], gamma=0.1)
        seen = list(range(t + 1))

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            tot_ce = tot_kd = 0.0
            for step, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    outs = model(x, seen)
                    loss_ce = F.cross_entropy(outs[-1], y - t * per)
                    loss_kd = torch.zeros((), device=device)
                    if teacher is not None:
                        with torch.no_grad():
                            t_outs = teacher(x, seen[:-1])
                        for s_o, t_o in zip(outs[:-1], t_outs):
                            loss_kd = loss_kd + kd_loss(s_o.float(), t_o.float(), args.temperature)
                    loss = loss_ce + args.lwf_lambda * loss_kd
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                tot_ce += loss_ce.item()
                tot_kd += loss_kd.item()
            sched.step()
            log.info("task %d epoch %d  ce %.3f  kd %.3f", t, epoch, tot_ce / len(loader), tot_kd / len(loader))

        for j in range(t + 1):
            acc[t, j] = evaluate_task(net, val_tasks[j], j, per, device, rank, world)
        log.info("task %d acc row: %s  mean %.2f", t,
                 " ".join(f"{a:.1f}" for a in acc[t, :t + 1].tolist()), acc[t, :t + 1].mean().item())

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "acc": acc, "task": t},
                       os.path.join(args.out, f"lwf_task{t:02d}.pt"))
        dist.barrier()

        # freeze a copy of the current model as the teacher for the next task
        teacher = copy.deepcopy(net).eval().requires_grad_(False)

    if rank == 0:
        final = acc[-1]
        bwt = sum(acc[-1, j] - acc[j, j] for j in range(args.tasks - 1)) / max(args.tasks - 1, 1)
        log.info("final avg acc %.2f  BWT %.2f", final.mean().item(), float(bwt))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
