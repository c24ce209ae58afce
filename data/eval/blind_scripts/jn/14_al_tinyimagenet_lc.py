"""Least-confidence active learning on Tiny-ImageNet-200 (ResNet-50, trained from scratch each round).

    torchrun --standalone --nproc_per_node=8 14_al_tinyimagenet_lc.py \
        --data /datasets/tiny-imagenet-200 --out /shared/al/tin_lc --wandb-project al-tin
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--wandb-project", default=None)
    ap.add_argument("--init", type=int, default=10000)
    ap.add_argument("--query", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch", type=int, default=512, help="global batch")
    ap.add_argument("--lr", type=float, default=0.2, help="for global batch 512")
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class TinyVal(Dataset):
    """Tiny-ImageNet val: flat images folder + val_annotations.txt."""

    def __init__(self, root, class_to_idx, transform):
        self.transform = transform
        self.samples = []
        with open(os.path.join(root, "val", "val_annotations.txt")) as f:
            for line in f:
                fname, wnid = line.split("\t")[:2]
                self.samples.append((os.path.join(root, "val", "images", fname), class_to_idx[wnid]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, y = self.samples[i]
        return self.transform(torchvision.datasets.folder.default_loader(path)), y


def resnet50_64px(num_classes=200):
    m = torchvision.models.resnet50(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def evaluate(model, ds, device, batch=256):
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=8, pin_memory=True)
    model.eval()
    correct, seen = 0, 0
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x.to(device, non_blocking=True)).argmax(1)
        correct += (pred.cpu() == y).sum().item()
        seen += y.numel()
    return correct / seen


@torch.no_grad()
def confidence(model, ds, idx, device):
    """max softmax prob for ds[idx]; returns (conf, idx) gathered from all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = np.concatenate([idx, idx[: (-len(idx)) % world]])
    mine = padded[rank::world]
    loader = DataLoader(Subset(ds, mine.tolist()), batch_size=512, num_workers=8, pin_memory=True)
    model.eval()
    conf = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            conf.append(model(x.to(device, non_blocking=True)).float().softmax(1).amax(1))
    conf = torch.cat(conf)
    mine_t = torch.as_tensor(mine, device=device)
    all_c = [torch.empty_like(conf) for _ in range(world)]
    all_i = [torch.empty_like(mine_t) for _ in range(world)]
    dist.all_gather(all_c, conf)
    dist.all_gather(all_i, mine_t)
    c, i = torch.cat(all_c).cpu().numpy(), torch.cat(all_i).cpu().numpy()
    i, first = np.unique(i, return_index=True)
    return c[first], i


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project:
            run = wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)

    mean, std = (0.480, 0.448, 0.398), (0.277, 0.269, 0.282)
    tf_train = transforms.Compose([transforms.RandomResizedCrop(64, scale=(0.35, 1)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize(mean, std)])
    tf_eval = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), tf_train)
    pool_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), tf_eval)
    val_ds = TinyVal(args.data, train_ds.class_to_idx, tf_eval)

    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(len(train_ds), args.init, replace=False))
    per_gpu = args.batch // world

    for rnd in range(args.rounds):
        t0 = time.time()
        torch.manual_seed(args.seed * 100 + rnd)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(resnet50_64px()).to(device)
        model = DDP(model, device_ids=[local_rank])
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=per_gpu, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * args.batch / 512, momentum=0.9,
                              weight_decay=5e-4, nesterov=True)
        warm = args.warmup_epochs * len(loader)
        total = args.epochs * len(loader)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm)], milestones=[warm])

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

        val_acc = evaluate(model.module, val_ds, device)

        unlabelled = np.setdiff1d(np.arange(len(train_ds)), labelled)
        conf, ids = confidence(model.module, pool_ds, unlabelled, device)
        query = ids[np.argsort(conf, kind="stable")[: args.query]]
        labelled = np.union1d(labelled, query)

        if rank == 0:
            elapsed = time.time() - t0
            print(f"round {rnd}: labelled {len(sub)}  val top-1 {val_acc:.4f}  ({elapsed / 60:.1f} min)", flush=True)
            if run is not None:
                run.log({"n_labelled": len(sub), "val_acc": val_acc, "round_minutes": elapsed / 60}, step=rnd)
            torch.save({"round": rnd, "model": model.module.state_dict(), "labelled": labelled.tolist(),
                        "val_acc": val_acc}, os.path.join(args.out, f"round{rnd:02d}.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
