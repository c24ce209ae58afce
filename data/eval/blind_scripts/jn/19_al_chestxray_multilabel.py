"""Active learning for multi-label chest X-ray classification (NIH ChestX-ray14, DenseNet-121).

Uncertainty = mean binary entropy over the 14 findings. The model is warm-started
from the previous round's checkpoint (round 0 starts from ImageNet weights).

    torchrun --standalone --nproc_per_node=4 19_al_chestxray_multilabel.py \
        --csv /data/nih-cxr14/Data_Entry_2017.csv --images /data/nih-cxr14/images \
        --split-list /data/nih-cxr14/train_val_list.txt --out /shared/al/cxr14
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--split-list", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", type=int, default=2000)
    p.add_argument("--query", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--bs", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam lr for 4 GPUs")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=2)
    return p.parse_args()


class CXR(Dataset):
    def __init__(self, df, img_dir, tf):
        self.files = df["Image Index"].tolist()
        labels = df["Finding Labels"].str.split("|")
        self.y = np.stack([[float(f in ls) for f in FINDINGS] for ls in labels]).astype(np.float32)
        self.img_dir, self.tf = img_dir, tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.files[i])).convert("RGB")
        return self.tf(img), torch.from_numpy(self.y[i]), i


def densenet121(pretrained):
    w = torchvision.models.DenseNet121_Weights.IMAGENET1K_V1 if pretrained else None
    m = torchvision.models.densenet121(weights=w)
    m.classifier = nn.Linear(m.classifier.in_features, len(FINDINGS))
    return m


@torch.no_grad()
def predict(net, ds, idx, device):
    sub = Subset(ds, idx.tolist())
    loader = DataLoader(sub, batch_size=128, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=8, pin_memory=True)
    net.eval()
    probs, ids = [], []
    for x, _, i in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = net(x.to(device, non_blocking=True))
        probs.append(torch.sigmoid(logits.float()))
        ids.append(i.to(device))
    probs, ids = torch.cat(probs), torch.cat(ids)
    world = dist.get_world_size()
    P = [torch.empty_like(probs) for _ in range(world)]
    I = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(P, probs)
    dist.all_gather(I, ids)
    probs, ids = torch.cat(P).cpu().numpy(), torch.cat(I).cpu().numpy()
    ids, first = np.unique(ids, return_index=True)
    return probs[first], ids


def mean_auc(probs, y):
    aucs = [roc_auc_score(y[:, k], probs[:, k]) for k in range(y.shape[1]) if 0 < y[:, k].sum() < len(y)]
    return float(np.mean(aucs))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv)
    with open(args.split_list) as f:
        keep = set(l.strip() for l in f)
    df = df[df["Image Index"].isin(keep)].reset_index(drop=True)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf_train = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.7, 1.0)), transforms.RandomRotation(7),
                                   transforms.ToTensor(), norm])
    tf_eval = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_ds, eval_ds = CXR(df, args.images, tf_train), CXR(df, args.images, tf_eval)

    # patient-level validation split so that no patient is in both sets
    patients = df["Patient ID"].unique()
    rng = np.random.default_rng(args.seed)
    val_patients = set(rng.choice(patients, int(args.val_frac * len(patients)), replace=False))
    is_val = df["Patient ID"].isin(val_patients).values
    val_idx, pool_idx = np.flatnonzero(is_val), np.flatnonzero(~is_val)
    labelled = np.sort(rng.choice(pool_idx, args.init, replace=False))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    prev_ckpt = None
    lr = args.lr * world / 4

    for rnd in range(args.rounds):
        t0 = time.time()
        model = densenet121(pretrained=prev_ckpt is None)
        if prev_ckpt is not None:
            ckpt = torch.load(prev_ckpt, map_location="cpu")
            model.load_state_dict(ckpt["model"])
        model = DDP(model.to(device), device_ids=[local_rank])

        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                            drop_last=True)
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))
        scaler = torch.cuda.amp.GradScaler()
        pos_frac = train_ds.y[labelled].mean(0).clip(1e-3, 1 - 1e-3)
        pos_weight = torch.tensor((1 - pos_frac) / pos_frac, device=device).clamp(max=50)

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)
                loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()

        v_probs, v_ids = predict(model.module, eval_ds, val_idx, device)
        auc = mean_auc(v_probs, eval_ds.y[v_ids])

        unlabelled = np.setdiff1d(pool_idx, labelled)
        probs, ids = predict(model.module, eval_ds, unlabelled, device)
        p = np.clip(probs, 1e-6, 1 - 1e-6)
        unc = -(p * np.log(p) + (1 - p) * np.log(1 - p)).mean(1)
        new = ids[np.argsort(-unc, kind="stable")[: args.query]]

        ckpt_path = os.path.join(args.out, f"round{rnd:02d}.pt")
        if rank == 0:
            torch.save({"model": model.state_dict(), "round": rnd, "val_auc": auc,
                        "labelled": labelled.tolist()}, ckpt_path)
            with open(os.path.join(args.out, "auc.jsonl"), "a") as f:
                f.write(json.dumps({"round": rnd, "n_labelled": len(labelled), "val_auc": auc,
                                    "min": round((time.time() - t0) / 60, 1)}) + "\n")
            print(f"round {rnd}: labelled={len(labelled)} val mAUC={auc:.4f}", flush=True)
        dist.barrier()
        prev_ckpt = ckpt_path
        labelled = np.union1d(labelled, new)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
