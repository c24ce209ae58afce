"""Food-101 ResNet-50 fine-tuning, moved from Horovod to torch.distributed.

Structure follows horovod/examples/pytorch/pytorch_imagenet_resnet50.py which we ran
with `horovodrun -np 8`; hvd.* calls are replaced by the small helpers below so
the rest of the file reads the same.

    torchrun --nproc_per_node=8 06_horovod_port_resnet.py --train-dir /data/food101/train --val-dir /data/food101/val
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

parser = argparse.ArgumentParser(description="Food-101 ResNet-50")
parser.add_argument("--train-dir", required=True)
parser.add_argument("--val-dir", required=True)
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before executing allreduce across workers")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size for training (per worker)")
parser.add_argument("--val-batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--base-lr", type=float, default=0.0125, help="learning rate for a single GPU")
parser.add_argument("--warmup-epochs", type=float, default=3)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--wd", type=float, default=5e-5)
parser.add_argument("--seed", type=int, default=42)


# --- hvd.* replacements -------------------------------------------------------
def hvd_rank():
    return dist.get_rank()


def hvd_size():
    return dist.get_world_size()


def hvd_local_rank():
    return int(os.environ["LOCAL_RANK"])


def broadcast_parameters(state_dict, root_rank=0):
    for tensor in state_dict.values():
        dist.broadcast(tensor, src=root_rank)


def metric_average(value, device):
    t = torch.tensor(float(value), device=device)
    dist.all_reduce(t)
    return t.item() / hvd_size()
# ------------------------------------------------------------------------------


class Metric:
    def __init__(self, name, device):
        self.name = name
        self.sum = torch.tensor(0.0, device=device)
        self.n = torch.tensor(0.0, device=device)

    def update(self, val, count=1):
        self.sum += val.detach() * count
        self.n += count

    @property
    def avg(self):
        buf = torch.stack([self.sum, self.n])
        dist.all_reduce(buf)
        return (buf[0] / buf[1]).item()


def accuracy(output, target):
    return output.argmax(dim=1).eq(target).float().mean()


def adjust_learning_rate(optimizer, epoch, batch_idx, steps_per_epoch, args):
    # Horovod recipe: linear warmup from base_lr to base_lr * size * batches_per_allreduce
    if epoch < args.warmup_epochs:
        ep = epoch + float(batch_idx + 1) / steps_per_epoch
        lr_adj = 1.0 / hvd_size() * (ep * (hvd_size() - 1) / args.warmup_epochs + 1)
    elif epoch < 15:
        lr_adj = 1.0
    elif epoch < 22:
        lr_adj = 1e-1
    else:
        lr_adj = 1e-2
    for g in optimizer.param_groups:
        g["lr"] = args.base_lr * hvd_size() * args.batches_per_allreduce * lr_adj


def train(epoch, model, optimizer, loader, sampler, device, args):
    model.train()
    sampler.set_epoch(epoch)
    train_loss, train_acc = Metric("train_loss", device), Metric("train_accuracy", device)
    accum = args.batches_per_allreduce
    steps = len(loader) // accum
    it = iter(loader)
    for step in range(steps):
        adjust_learning_rate(optimizer, epoch, step, steps, args)
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accum):
            data, target = next(it)
            data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
            if micro < accum - 1:
                with model.no_sync():
                    output = model(data)
                    loss = F.cross_entropy(output, target) / accum
                    loss.backward()
            else:
                output = model(data)
                loss = F.cross_entropy(output, target) / accum
                loss.backward()
            train_loss.update(loss * accum, data.size(0))
            train_acc.update(accuracy(output, target), data.size(0))
        optimizer.step()
    return train_loss.avg, train_acc.avg


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for data, target in loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)
        loss_sum += F.cross_entropy(output, target, reduction="sum")
        correct += output.argmax(1).eq(target).sum()
        total += target.numel()
    for t in (loss_sum, correct, total):
        dist.all_reduce(t)
    return (loss_sum / total).item(), (correct / total).item()


def main():
    args = parser.parse_args()
    torch.cuda.set_device(hvd_local_rank())
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", hvd_local_rank())
    torch.manual_seed(args.seed)
    verbose = hvd_rank() == 0

    # Rank 0 looks for the newest checkpoint and tells everyone where to start.
    resume_from_epoch = 0
    if hvd_rank() == 0:
        for try_epoch in range(args.epochs, 0, -1):
            if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
                resume_from_epoch = try_epoch
                break
    resume_t = torch.tensor(resume_from_epoch, device=device)
    dist.broadcast(resume_t, src=0)
    resume_from_epoch = int(resume_t.item())

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = torchvision.datasets.ImageFolder(args.train_dir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_dataset = torchvision.datasets.ImageFolder(args.val_dir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd_size(), rank=hvd_rank())
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_indices = list(range(hvd_rank(), len(val_dataset), hvd_size()))
    val_loader = DataLoader(torch.utils.data.Subset(val_dataset, val_indices),
                            batch_size=args.val_batch_size, num_workers=4, pin_memory=True)

    model = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    model.fc = nn.Linear(model.fc.in_features, len(train_dataset.classes))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * args.batches_per_allreduce * hvd_size(),
                                momentum=args.momentum, weight_decay=args.wd)

    if resume_from_epoch > 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    # hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_parameters(model.state_dict(), root_rank=0)
    model = DDP(model, device_ids=[hvd_local_rank()])

    if verbose:
        print(f"workers={hvd_size()} per_worker_batch={args.batch_size} "
              f"allreduce_batch={args.batch_size * args.batches_per_allreduce * hvd_size()}")

    best_acc = 0.0
    for epoch in range(resume_from_epoch, args.epochs):
        tr_loss, tr_acc = train(epoch, model, optimizer, train_loader, train_sampler, device, args)
        val_loss, val_acc = validate(model, val_loader, device)
        lr_now = metric_average(optimizer.param_groups[0]["lr"], device)
        if verbose:
            print(f"epoch {epoch + 1}: loss={tr_loss:.4f} acc={tr_acc:.4f} "
                  f"val_loss={val_loss:.4f} val_acc={val_acc:.4f} lr={lr_now:.5f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "val_acc": val_acc}
            torch.save(state, args.checkpoint_format.format(epoch=epoch + 1))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), "food101_r50_best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
