"""
Multi-task fine-tuning: one ConvNeXt backbone, two heads.
  * species head   - single-label, trained on the species CSV
  * attribute head - 312 binary attributes, trained on the attributes CSV
Each optimizer step draws ONE task; the other head gets no gradient in that step.

    torchrun --nproc_per_node=4 11_multitask_birds_ddp.py --species-csv meta/species.csv \
        --attr-csv meta/attributes.csv --image-root /data/birds
"""
import argparse
import contextlib
import os
import random
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--species-csv", required=True)
    p.add_argument("--attr-csv", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--backbone", default="convnext_small.fb_in22k")
    p.add_argument("--num-species", type=int, default=200)
    p.add_argument("--num-attrs", type=int, default=312)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4, help="per 256 images")
    p.add_argument("--attr-prob", type=float, default=0.3, help="probability of an attribute step")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--out", default="runs/multitask")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CsvImageDataset(Dataset):
    def __init__(self, csv_path, image_root, split, transform, label_cols):
        df = pd.read_csv(csv_path)
        df = df[df["split"] == split].reset_index(drop=True)
        self.paths = df["path"].tolist()
        self.targets = df[label_cols].values
        self.root = image_root
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        target = torch.as_tensor(self.targets[i])
        return self.transform(img), target.squeeze(0) if target.numel() == 1 else target.float()


class MultiTaskNet(nn.Module):
    def __init__(self, backbone, num_species, num_attrs):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0)
        dim = self.backbone.num_features
        self.species_head = nn.Linear(dim, num_species)
        self.attr_head = nn.Sequential(nn.Linear(dim, 512), nn.GELU(), nn.Linear(512, num_attrs))

    def forward(self, x, task):
        feats = self.backbone(x)
        if task == "species":
            return self.species_head(feats)
        return self.attr_head(feats)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def make_loader(ds, batch_size, train):
    sampler = DistributedSampler(ds, shuffle=train, drop_last=True)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=train, persistent_workers=train)
    return loader, sampler


@torch.no_grad()
def evaluate(model, species_loader, attr_loader, device):
    model.eval()
    s = torch.zeros(4, device=device)  # species correct, species n, attr correct, attr n
    for x, y in species_loader:
        x, y = x.to(device), y.to(device)
        s[0] += (model(x, "species").argmax(1) == y).sum()
        s[1] += y.numel()
    for x, y in attr_loader:
        x, y = x.to(device), y.to(device)
        s[2] += ((model(x, "attr") > 0).float() == y).sum()
        s[3] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item(), (s[2] / s[3]).item()


def main():
    args = parse_args()
    local_rank = setup()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)
    # identical on every rank: all ranks must pick the same task for a step
    task_rng = random.Random(args.seed)

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    eval_tf = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224),
        transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    attr_cols = [f"a{i}" for i in range(args.num_attrs)]
    sp_train = CsvImageDataset(args.species_csv, args.image_root, "train", train_tf, ["label"])
    sp_val = CsvImageDataset(args.species_csv, args.image_root, "val", eval_tf, ["label"])
    at_train = CsvImageDataset(args.attr_csv, args.image_root, "train", train_tf, attr_cols)
    at_val = CsvImageDataset(args.attr_csv, args.image_root, "val", eval_tf, attr_cols)

    sp_loader, sp_sampler = make_loader(sp_train, args.batch_size, train=True)
    at_loader, at_sampler = make_loader(at_train, args.batch_size, train=True)
    sp_val_loader, _ = make_loader(sp_val, 64, train=False)
    at_val_loader, _ = make_loader(at_val, 64, train=False)
    streams = {"species": infinite(sp_loader, sp_sampler), "attr": infinite(at_loader, at_sampler)}

    model = MultiTaskNet(args.backbone, args.num_species, args.num_attrs).to(device)
    # only one head takes part in each step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    lr = args.lr * args.batch_size * args.accum * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    start_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_step = ckpt["step"]
        task_rng.setstate(ckpt["task_rng"])

    if is_main_process():
        os.makedirs(args.out, exist_ok=True)

    pbar = tqdm(range(start_step, args.steps), disable=not is_main_process())
    for step in pbar:
        task = "attr" if task_rng.random() < args.attr_prob else "species"
        for micro in range(args.accum):
            x, y = next(streams[task])
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # skip the gradient all-reduce on all but the last micro-batch
            sync_ctx = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with sync_ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x, task)
                    if task == "species":
                        loss = F.cross_entropy(out, y, label_smoothing=0.1)
                    else:
                        loss = F.binary_cross_entropy_with_logits(out.float(), y)
                (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if is_main_process() and step % 20 == 0:
            pbar.set_postfix(task=task, loss=f"{loss.item():.3f}")

        if (step + 1) % args.eval_every == 0:
            sp_acc, at_acc = evaluate(model, sp_val_loader, at_val_loader, device)
            if is_main_process():
                print(f"step {step + 1}: species acc {sp_acc:.4f}  attr acc {at_acc:.4f}", flush=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step + 1,
                            "task_rng": task_rng.getstate()},
                           os.path.join(args.out, "last.pt"))
            dist.barrier()

    cleanup()


if __name__ == "__main__":
    main()
