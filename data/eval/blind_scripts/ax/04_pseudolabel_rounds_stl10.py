#!/usr/bin/env python
"""Iterative pseudo-labelling (self-training) on STL-10.

round 0 : train on the 5k labelled images
round r : label the 100k unlabelled images with the round r-1 model, keep the
          predictions above a confidence threshold, train a fresh student on
          labelled + pseudo-labelled data.

torchrun --nnodes=1 --nproc_per_node=4 pseudolabel_rounds_stl10.py --rounds 4
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser(description="STL-10 self-training")
    p.add_argument("--data-dir", default="/datasets/stl10")
    p.add_argument("--output-dir", default="output/stl10_st")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class PseudoLabeled(Dataset):
    def __init__(self, base, indices, labels):
        self.base, self.indices, self.labels = base, indices, labels

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, _ = self.base[self.indices[i]]
        return x, self.labels[i]


def create_model():
    m = torchvision.models.resnet50(num_classes=10)
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


def train_one_round(model, dataset, args, device, rank, rnd):
    sampler = DistributedSampler(dataset, shuffle=True, seed=rnd)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=5e-4, nesterov=True)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps,
                                                pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
        if rank == 0 and epoch % 10 == 0:
            print(f"[r{rnd} e{epoch}] loss={loss.item():.4f} "
                  f"{len(loader) / (time.time() - t0):.1f} it/s", flush=True)


@torch.no_grad()
def pseudo_label(net, unlabeled, args, device, world_size):
    """Predicts this rank's shard of the unlabelled set and keeps confident samples."""
    sampler = DistributedSampler(unlabeled, shuffle=False)
    loader = DataLoader(unlabeled, batch_size=256, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True)
    shard = torch.tensor(list(sampler), dtype=torch.long)
    net.eval()
    confs, preds = [], []
    for x, _ in loader:
        with torch.cuda.amp.autocast(enabled=args.amp):
            logits = net(x.to(device, non_blocking=True))
        p = logits.float().softmax(1)
        c, y = p.max(1)
        confs.append(c)
        preds.append(y)
    confs, preds = torch.cat(confs), torch.cat(preds)
    keep = confs >= args.threshold
    keep_idx = shard.to(device)[keep]
    keep_lab = preds[keep]

    idx_list = [torch.zeros_like(keep_idx) for _ in range(world_size)]
    lab_list = [torch.zeros_like(keep_lab) for _ in range(world_size)]
    dist.all_gather(idx_list, keep_idx)
    dist.all_gather(lab_list, keep_lab)
    idx = torch.cat(idx_list).cpu()
    lab = torch.cat(lab_list).cpu()
    # DistributedSampler pads with repeated samples; drop duplicates
    idx, first = torch.unique(idx, return_inverse=True)
    lab_u = torch.empty_like(idx)
    lab_u[first] = lab
    return idx.tolist(), lab_u.tolist()


@torch.no_grad()
def test(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        s[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
        s[1] += len(y)
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize((0.447, 0.440, 0.407), (0.260, 0.257, 0.271))
    train_tf = T.Compose([T.RandomResizedCrop(96, scale=(0.5, 1.0)),
                          T.RandomHorizontalFlip(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.ToTensor(), norm])
    labeled = torchvision.datasets.STL10(args.data_dir, split="train", transform=train_tf)
    unl_eval = torchvision.datasets.STL10(args.data_dir, split="unlabeled", transform=eval_tf)
    unl_train = torchvision.datasets.STL10(args.data_dir, split="unlabeled", transform=train_tf)
    test_set = torchvision.datasets.STL10(args.data_dir, split="test", transform=eval_tf)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=4,
                             sampler=DistributedSampler(test_set, shuffle=False))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    train_set = labeled
    for rnd in range(args.rounds + 1):
        torch.manual_seed(1000 + rnd)
        model = DDP(create_model().to(device), device_ids=[local_rank])
        train_one_round(model, train_set, args, device, rank, rnd)
        acc = test(model.module, test_loader, device)
        if rank == 0:
            print(f"== round {rnd}: train size {len(train_set)}, test acc {acc:.4f}", flush=True)
            torch.save({"round": rnd, "state_dict": model.module.state_dict(), "acc": acc},
                       os.path.join(args.output_dir, f"student_r{rnd}.pth"))
        if rnd == args.rounds:
            break
        idx, lab = pseudo_label(model.module, unl_eval, args, device, world_size)
        if rank == 0:
            print(f"   pseudo-labelled {len(idx)}/{len(unl_eval)} at t={args.threshold}")
        train_set = ConcatDataset([labeled, PseudoLabeled(unl_train, idx, lab)])
        del model
        torch.cuda.empty_cache()

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
