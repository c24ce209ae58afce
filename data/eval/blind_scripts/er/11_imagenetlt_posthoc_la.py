"""ImageNet-LT: ERM training + post-hoc logit adjustment sweep (Menon et al. 2021).

Trains plain softmax CE, then at every evaluation reports the test accuracy of
argmax(logits - tau * log(prior)) for a few tau values, where the prior is the
label frequency counted over the full ImageNet-LT training list.

    torchrun --nproc_per_node=8 imagenetlt_posthoc_la.py --wandb-project lt-posthoc
"""
import argparse
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from PIL import Image
from timm.data import create_transform
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TAUS = (0.0, 0.5, 1.0, 1.5, 2.0)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--imagenet", default="/datasets/imagenet")
    p.add_argument("--lt-lists", default="/datasets/ImageNet_LT")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="base lr per 256 images")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="outputs/posthoc_la")
    p.add_argument("--wandb-project", default="lt-posthoc")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


class LTList(Dataset):
    def __init__(self, root, list_file, transform):
        self.root, self.transform = root, transform
        self.samples = []
        with open(list_file) as f:
            for line in f:
                rel, y = line.split()
                self.samples.append((rel, int(y)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        rel, y = self.samples[i]
        return self.transform(Image.open(os.path.join(self.root, rel)).convert("RGB")), y


@torch.no_grad()
def evaluate(model, loader, log_prior, shot_groups, device):
    model.eval()
    C = log_prior.numel()
    hits = torch.zeros(len(TAUS), C, device=device)
    count = torch.zeros(C, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).float()
        count += torch.bincount(y, minlength=C)
        for t, tau in enumerate(TAUS):
            pred = (logits - tau * log_prior).argmax(1)
            hits[t] += torch.bincount(y, weights=(pred == y).float(), minlength=C)
    dist.all_reduce(hits)
    dist.all_reduce(count)
    per_class = hits / count.clamp(min=1)
    out = {}
    for t, tau in enumerate(TAUS):
        out[f"tau{tau}/top1"] = (hits[t].sum() / count.sum()).item()
        for name, mask in shot_groups.items():
            out[f"tau{tau}/{name}"] = per_class[t][mask].mean().item()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args) | {"world_size": world})

    train_set = LTList(args.imagenet, os.path.join(args.lt_lists, "ImageNet_LT_train.txt"),
                       create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1"))
    test_set = LTList(args.imagenet, os.path.join(args.lt_lists, "ImageNet_LT_test.txt"),
                      create_transform(224, is_training=False))
    counts = np.bincount([y for _, y in train_set.samples], minlength=1000)
    prior = torch.tensor(counts / counts.sum(), dtype=torch.float32, device=device)
    log_prior = torch.log(prior.clamp(min=1e-12))
    counts_t = torch.tensor(counts, device=device)
    shot_groups = {"many": counts_t > 100, "medium": (counts_t >= 20) & (counts_t <= 100), "few": counts_t < 20}

    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # 50 images per class in the test list -> 50000, divides evenly over 8 ranks; no padding
    shard = np.array_split(np.arange(len(test_set)), world)[rank]
    test_loader = DataLoader(torch.utils.data.Subset(test_set, shard.tolist()), batch_size=250,
                             num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, num_classes=1000).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    n_iter = len(train_loader)
    scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * n_iter, warmup_t=args.warmup_epochs * n_iter,
                                  warmup_lr_init=1e-4, lr_min=1e-6, t_in_epochs=False)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            scheduler.step_update(step)
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": optimizer.param_groups[0]["lr"],
                           "epoch": epoch}, step=step)

        metrics = evaluate(model.module, test_loader, log_prior, shot_groups, device)
        metrics["epoch_time"] = time.time() - tic
        wandb.log(metrics, step=step)
        if rank == 0:
            best_tau = max(TAUS, key=lambda t: metrics[f"tau{t}/top1"])
            print(f"epoch {epoch}: erm top1 {100 * metrics['tau0.0/top1']:.2f}, "
                  f"best tau {best_tau} -> {100 * metrics[f'tau{best_tau}/top1']:.2f} "
                  f"(few {100 * metrics[f'tau{best_tau}/few']:.2f})", flush=True)
            os.makedirs(args.output, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "counts": counts},
                       os.path.join(args.output, "checkpoint.pth"))

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
