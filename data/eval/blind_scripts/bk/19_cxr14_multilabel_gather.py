"""ChestX-ray14 multi-label classification (DenseNet-121), hand-written data
parallelism. Validation predictions from all ranks are gathered so the
per-finding AUROC is computed on the complete validation list.

    torchrun --nproc_per_node=4 19_cxr14_multilabel_gather.py --root /data/cxr14
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import DenseNet121_Weights, densenet121

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--img-size", type=int, default=384)
    ap.add_argument("--out", default="runs/cxr14_dn121")
    return ap.parse_args()


class CXR14(Dataset):
    def __init__(self, root, list_file, tf):
        df = pd.read_csv(os.path.join(root, "Data_Entry_2017.csv"))
        keep = set(open(os.path.join(root, list_file)).read().split())
        df = df[df["Image Index"].isin(keep)].reset_index(drop=True)
        self.paths = [os.path.join(root, "images", f) for f in df["Image Index"]]
        labels = df["Finding Labels"].str.split("|")
        self.y = np.array([[f in ls for f in FINDINGS] for ls in labels], dtype=np.float32)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), torch.from_numpy(self.y[i])


def gather_variable(t, world):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    padded = t.new_zeros((max(sizes),) + t.shape[1:])
    padded[:t.size(0)] = t
    bufs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(args.img_size, scale=(0.7, 1.0)), T.RandomRotation(7),
                          T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(args.img_size), T.CenterCrop(args.img_size), T.ToTensor(), norm])
    train_ds = CXR14(args.root, "train_val_list.txt", train_tf)
    val_ds = CXR14(args.root, "test_list.txt", val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=64, num_workers=8, pin_memory=True)

    model = densenet121(weights=DenseNet121_Weights.IMAGENET1K_V1)
    model.classifier = nn.Linear(model.classifier.in_features, len(FINDINGS))
    model = model.to(device)
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)

    # rare findings get a larger positive weight
    pos = train_ds.y.mean(0)
    pos_weight = torch.tensor((1 - pos) / np.clip(pos, 1e-3, None), dtype=torch.float32).clamp(max=50)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight.to("cuda:0"))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world, weight_decay=1e-5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.1, patience=1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} / test {len(val_ds)} images on {world} GPUs", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        # BN statistics differ per replica after an epoch; use the average
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    dist.all_reduce(b, op=dist.ReduceOp.AVG)

        model.eval()
        probs, targets = [], []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                probs.append(torch.sigmoid(model(x.to(device, non_blocking=True)).float()))
                targets.append(y.to(device))
        all_p = gather_variable(torch.cat(probs), world).cpu().numpy()
        all_y = gather_variable(torch.cat(targets), world).cpu().numpy()
        aucs = [roc_auc_score(all_y[:, k], all_p[:, k]) for k in range(len(FINDINGS))]
        mean_auc = float(np.mean(aucs))
        plateau.step(mean_auc)  # same value on every rank, so lr stays in step
        if rank == 0:
            print(f"epoch {epoch} mean AUROC {mean_auc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            print("  " + " ".join(f"{f[:6]}={a:.3f}" for f, a in zip(FINDINGS, aucs)), flush=True)
            if mean_auc > best:
                best = mean_auc
                torch.save({"model": model.state_dict(), "epoch": epoch, "auroc": aucs},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
