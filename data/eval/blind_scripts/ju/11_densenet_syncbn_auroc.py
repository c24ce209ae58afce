"""Stage-1 of the report generator: pretrain the DenseNet-121 visual encoder on the
14 CheXpert observations (labels from CheXbert run on the reports).

Validation AUROC is computed over the full validation set: every rank scores a
strided shard, the (variable-sized) shards are gathered to rank 0.

    torchrun --nproc_per_node=4 11_densenet_syncbn_auroc.py --labels data/mimic_chexbert_labels.csv
"""
import argparse
import hashlib
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T

OBS = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum",
       "Fracture", "Lung Lesion", "Lung Opacity", "No Finding", "Pleural Effusion", "Pleural Other",
       "Pneumonia", "Pneumothorax", "Support Devices"]


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--labels", required=True)
    p.add_argument("--images", default="data/mimic-cxr-jpg/files")
    p.add_argument("--out", default="runs/densenet_pretrain")
    p.add_argument("--init", default="", help="optional torchxrayvision / CheXpert weights (.pt)")
    p.add_argument("--bs", type=int, default=32, help="per GPU")
    p.add_argument("--base-lr", type=float, default=1e-4, help="for a global batch of 128")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--uncertain", choices=["ones", "zeros"], default="ones")
    return p.parse_args()


def patient_fold(subject_id, n_folds=10):
    h = hashlib.md5(str(subject_id).encode()).hexdigest()
    return int(h, 16) % n_folds


class Observations(Dataset):
    def __init__(self, df, root, train, uncertain):
        self.df = df.reset_index(drop=True)
        self.root = root
        y = self.df[OBS].fillna(0.0).values.astype(np.float32)
        self.y = np.where(y == -1, 1.0 if uncertain == "ones" else 0.0, y).astype(np.float32)
        aug = [T.RandomResizedCrop(224, scale=(0.85, 1.0)), T.RandomRotation(8)] if train else \
              [T.Resize(256), T.CenterCrop(224)]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.df.path[i])).convert("RGB")
        return self.tf(img), torch.from_numpy(self.y[i])


def build_model(init):
    net = torchvision.models.densenet121(weights="IMAGENET1K_V1")
    net.classifier = nn.Linear(net.classifier.in_features, len(OBS))
    if init:
        sd = torch.load(init, map_location="cpu")
        sd = {k.replace("module.", "", 1): v for k, v in sd.get("state_dict", sd).items()}
        sd = {k: v for k, v in sd.items() if not k.startswith("classifier.")}
        net.load_state_dict(sd, strict=False)
    return net


def gather_variable(t, world):
    """all_gather for tensors whose first dimension differs between ranks."""
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.size(0)] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(model, loader, device, world):
    net = model.module          # shards differ in length; keep DDP's forward out of eval
    net.eval()
    probs, targets = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logits.float()))
        targets.append(y.to(device))
    p = torch.cat(probs) if probs else torch.zeros(0, len(OBS), device=device)
    y = torch.cat(targets) if targets else torch.zeros(0, len(OBS), device=device)
    p, y = gather_variable(p, world), gather_variable(y, world)
    net.train()
    p, y = p.cpu().numpy(), y.cpu().numpy()
    aucs = {}
    for j, name in enumerate(OBS):
        if 0 < y[:, j].sum() < len(y):
            aucs[name] = roc_auc_score(y[:, j], p[:, j])
    return aucs, len(y)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    df = pd.read_csv(args.labels)
    df["fold"] = df.subject_id.map(patient_fold)
    train_ds = Observations(df[df.fold > 0], args.images, True, args.uncertain)
    val_ds = Observations(df[df.fold == 0], args.images, False, args.uncertain)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs * 2, num_workers=8,
                        pin_memory=True)

    model = build_model(args.init)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.bs * world / 128
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.1)
    criterion = nn.BCEWithLogitsLoss()
    tb = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tb = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"world={world} global_batch={args.bs * world} lr={lr:.2e} "
              f"train={len(train_ds)} val={len(val_ds)}", flush=True)

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), step)

        aucs, n = evaluate(model, val_dl, device, world)
        mean_auc = float(np.mean(list(aucs.values())))
        if rank == 0:
            tb.add_scalar("val/mean_auroc", mean_auc, step)
            for k, v in aucs.items():
                tb.add_scalar(f"val_auroc/{k}", v, step)
            print(f"epoch {epoch} mean AUROC {mean_auc:.4f} on {n} images ({time.time() - t0:.0f}s)", flush=True)
            state = {"state_dict": model.module.state_dict(), "epoch": epoch, "auroc": aucs}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if mean_auc > best:
                best = mean_auc
                torch.save(state, os.path.join(args.out, "best_encoder.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
