"""SWAG on ImageNet, starting from a pretrained ResNet-50 solution.

As in Maddox et al. (2019, Sec. 5.3): take a converged ImageNet model, run
SGD with a constant learning rate for a few more epochs and collect the SWAG
moments (diagonal + rank-K deviations) 4 times per epoch. Moments are kept on
the CPU of rank 0 (weights are identical on all replicas under DDP). BMA
evaluation is done afterwards by swag_eval.py.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node001:29400 \
        10_swag_imagenet_from_pretrained.py --data /mnt/lustre/imagenet \
        --init /mnt/lustre/ckpt/resnet50_sgd/model_best.pth.tar --out /mnt/lustre/ckpt/resnet50_swag
"""
import argparse
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--init", required=True, help="checkpoint of the pretrained SGD solution")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--swag-lr", type=float, default=0.02)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--max-rank", type=int, default=20)
    p.add_argument("--collects-per-epoch", type=int, default=4)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


class SWAGMoments:
    def __init__(self, model, max_rank):
        self.names = [n for n, _ in model.named_parameters()]
        self.mean = OrderedDict((n, torch.zeros_like(p, device="cpu")) for n, p in model.named_parameters())
        self.sq_mean = OrderedDict((n, torch.zeros_like(p, device="cpu")) for n, p in model.named_parameters())
        self.deviations = []
        self.n = 0
        self.max_rank = max_rank

    @torch.no_grad()
    def collect(self, model):
        cur = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        for n in self.names:
            self.mean[n].mul_(self.n / (self.n + 1)).add_(cur[n] / (self.n + 1))
            self.sq_mean[n].mul_(self.n / (self.n + 1)).add_(cur[n] ** 2 / (self.n + 1))
        self.deviations.append(torch.cat([(cur[n] - self.mean[n]).flatten() for n in self.names]).half())
        if len(self.deviations) > self.max_rank:
            self.deviations.pop(0)
        self.n += 1

    def state_dict(self):
        return {"mean": self.mean, "sq_mean": self.sq_mean, "deviations": self.deviations,
                "n": self.n, "max_rank": self.max_rank}

    def load_state_dict(self, sd):
        self.mean, self.sq_mean = sd["mean"], sd["sq_mean"]
        self.deviations, self.n = sd["deviations"], sd["n"]


def strip_prefix(sd, prefix="module."):
    return OrderedDict((k[len(prefix):] if k.startswith(prefix) else k, v) for k, v in sd.items())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_shard = Subset(val_set, range(rank, len(val_set), world))  # no padded duplicates
    val_loader = DataLoader(val_shard, batch_size=100, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = torchvision.models.__dict__[args.arch]()
    init = torch.load(args.init)
    model.load_state_dict(strip_prefix(init["state_dict"]))
    if rank == 0:
        print(f"=> loaded pretrained solution {args.init} (epoch {init.get('epoch')}, "
              f"acc@1 {init.get('best_acc1')})", flush=True)
    del init
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    opt = torch.optim.SGD(ddp.parameters(), lr=args.swag_lr, momentum=0.9, weight_decay=args.wd)
    swag = SWAGMoments(model, args.max_rank) if rank == 0 else None
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            swag.load_state_dict(ck["swag"])

    collect_at = {int(round(len(train_loader) * (k + 1) / args.collects_per_epoch)) - 1
                  for k in range(args.collects_per_epoch)}
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(images), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 200 == 0:
                print(f"ep {epoch} [{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)
            if i in collect_at and rank == 0:
                swag.collect(model)

        # SGD-iterate validation (sanity check that constant LR stays near the optimum)
        ddp.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for images, target in val_loader:
                out = ddp(images.to(device, non_blocking=True))
                correct[0] += out.argmax(1).eq(target.to(device)).sum()
                correct[1] += target.numel()
        dist.all_reduce(correct)
        if rank == 0:
            print(f"ep {epoch} val acc@1 (SGD iterate) {(correct[0] / correct[1]).item():.4f} "
                  f"swag_n {swag.n} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "swag": swag.state_dict(), "args": vars(args)},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    if rank == 0:
        torch.save(swag.state_dict(), os.path.join(args.out, "swag_moments.pth"))
        print("saved SWAG moments:", swag.n, "snapshots,", len(swag.deviations), "deviation columns")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
