"""Plant Pathology 2021 - stage 2: pseudo-label the unlabeled pool with the stage-1
teacher and fine-tune a student on labeled + confident pseudo-labeled images.

torchrun --nproc_per_node=4 05_plant_pathology_pseudo_label.py \
    --teacher weights/stage1_effb3_fold0.pth --threshold 0.9
"""
import argparse
import glob
import itertools
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

LABELS = ["complex", "frog_eye_leaf_spot", "healthy", "powdery_mildew", "rust", "scab"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", default="data/train_folds.csv")
    p.add_argument("--img_dir", default="data/train_images")
    p.add_argument("--unlabeled_dir", default="data/extra_images")
    p.add_argument("--teacher", required=True)
    p.add_argument("--arch", default="tf_efficientnet_b3_ns")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", default="weights/stage2_student_fold0.pth")
    return p.parse_args()


def tfms(size, train):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
    return T.Compose([T.Resize((size, size)), T.ToTensor(), norm])


class LeafDS(Dataset):
    def __init__(self, paths, targets=None, tf=None):
        self.paths = list(paths)
        self.targets = targets
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.tf(Image.open(self.paths[i]).convert("RGB"))
        if self.targets is None:
            return img, torch.zeros(len(LABELS))
        return img, torch.as_tensor(self.targets[i], dtype=torch.float32)


def multi_hot(df):
    y = np.zeros((len(df), len(LABELS)), dtype=np.float32)
    for r, lab in enumerate(df["labels"].values):
        for l in lab.split():
            y[r, LABELS.index(l)] = 1.0
    return y


@torch.no_grad()
def predict_shard(model, loader, device):
    model.eval()
    out = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(torch.sigmoid(model(x.to(device))).float().cpu())
    return torch.cat(out).numpy()


def pseudo_label(teacher, paths, rank, world, args, device):
    """Each rank labels its own slice of the unlabeled pool."""
    my_paths = paths[rank::world]
    ds = LeafDS(my_paths, tf=tfms(args.size, train=False))
    probs = predict_shard(teacher, DataLoader(ds, batch_size=args.bs * 2, num_workers=4), device)
    # keep images where every label is confidently on or off
    conf = np.all((probs > args.threshold) | (probs < 1 - args.threshold), axis=1)
    keep = np.where(conf)[0]
    hard = (probs[keep] > 0.5).astype(np.float32)
    return [my_paths[i] for i in keep], hard


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.train_csv)
    trn, val = df[df.fold != args.fold], df[df.fold == args.fold]
    trn_paths = [os.path.join(args.img_dir, f) for f in trn.image]
    val_paths = [os.path.join(args.img_dir, f) for f in val.image]

    teacher = timm.create_model(args.arch, pretrained=False, num_classes=len(LABELS))
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device)
    unlabeled = sorted(glob.glob(os.path.join(args.unlabeled_dir, "*.jpg")))
    pl_paths, pl_targets = pseudo_label(teacher, unlabeled, rank, world, args, device)
    del teacher
    torch.cuda.empty_cache()
    n_pl = torch.tensor([len(pl_paths)], device=device)
    dist.all_reduce(n_pl)
    if rank == 0:
        print(f"pseudo-labeled {n_pl.item()} / {len(unlabeled)} images (thr={args.threshold})", flush=True)

    train_ds = LeafDS(trn_paths, multi_hot(trn), tfms(args.size, True))
    pl_ds = LeafDS(pl_paths, pl_targets, tfms(args.size, True))
    val_ds = LeafDS(val_paths, multi_hot(val), tfms(args.size, False))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    pl_dl = DataLoader(pl_ds, batch_size=args.bs, shuffle=True, num_workers=6,
                       pin_memory=True, drop_last=True)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))
    val_dl = DataLoader(val_shard, batch_size=args.bs * 2, num_workers=4)

    student = timm.create_model(args.arch, pretrained=False, num_classes=len(LABELS), drop_path_rate=0.2)
    student.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    student = DDP(student.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best_f1 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        for step, (x, y) in enumerate(itertools.chain(train_dl, pl_dl)):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(student(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} it {step} loss {loss.item():.4f}", flush=True)
        sched.step()

        probs = predict_shard(student.module, val_dl, device)
        preds = torch.from_numpy(probs > 0.5).to(device).float()
        ys = torch.from_numpy(multi_hot(val.iloc[rank::world])).to(device)
        tp = (preds * ys).sum(0)
        fp = (preds * (1 - ys)).sum(0)
        fn = ((1 - preds) * ys).sum(0)
        stats = torch.stack([tp, fp, fn])
        dist.all_reduce(stats)
        tp, fp, fn = stats
        f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).mean().item()
        if rank == 0:
            print(f"epoch {epoch} val macro-F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                torch.save(student.module.state_dict(), args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
