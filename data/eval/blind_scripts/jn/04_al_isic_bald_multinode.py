"""BALD active learning for ISIC-2019 skin lesion classification (multi-node).

sbatch wrapper (2 nodes x 4 A100):
    srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        04_al_isic_bald_multinode.py --csv /project/isic2019/train.csv \
        --images /project/isic2019/images --ckpt-dir /project/al_runs/isic_bald
"""
import argparse
import json
import os
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

CLASSES = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "al_isic"))
    p.add_argument("--arch", default="efficientnet_b0")
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--init", type=int, default=500)
    p.add_argument("--query", type=int, default=500)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--bs", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--mc", type=int, default=10, help="MC-dropout passes for BALD")
    p.add_argument("--test-frac", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class ISIC(Dataset):
    def __init__(self, df, img_dir, tf):
        self.paths = [os.path.join(img_dir, f + ".jpg") for f in df["image"]]
        self.labels = df[CLASSES].values.argmax(1)
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.tf(img), int(self.labels[i]), i


def build_model(arch, n_classes, p_drop=0.3):
    backbone = timm.create_model(arch, pretrained=True, num_classes=0)
    return nn.Sequential(backbone, nn.Dropout(p_drop), nn.Linear(backbone.num_features, n_classes))


def enable_mc_dropout(model):
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train()


@torch.no_grad()
def bald_scores(net, ds, pool, device, mc):
    sampler = DistributedSampler(Subset(ds, pool.tolist()), shuffle=False)
    loader = DataLoader(Subset(ds, pool.tolist()), batch_size=128, sampler=sampler,
                        num_workers=6, pin_memory=True)
    enable_mc_dropout(net)
    scores, ids = [], []
    for x, _, i in loader:
        x = x.to(device, non_blocking=True)
        probs = torch.stack([F.softmax(net(x).float(), dim=1) for _ in range(mc)])  # T,B,C
        mean = probs.mean(0)
        h_mean = -(mean * mean.clamp_min(1e-10).log()).sum(1)
        mean_h = -(probs * probs.clamp_min(1e-10).log()).sum(2).mean(0)
        scores.append(h_mean - mean_h)
        ids.append(i.to(device))
    scores, ids = torch.cat(scores), torch.cat(ids)
    all_s = [torch.empty_like(scores) for _ in range(dist.get_world_size())]
    all_i = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(all_s, scores)
    dist.all_gather(all_i, ids)
    return torch.cat(all_s).cpu(), torch.cat(all_i).cpu()


@torch.no_grad()
def balanced_accuracy(net, ds, idx, device):
    part = np.array_split(idx, dist.get_world_size())[dist.get_rank()]
    loader = DataLoader(Subset(ds, part.tolist()), batch_size=128, num_workers=6)
    net.eval()
    conf = torch.zeros(len(CLASSES), len(CLASSES), device=device, dtype=torch.long)
    for x, y, _ in loader:
        pred = net(x.to(device, non_blocking=True)).argmax(1)
        y = y.to(device)
        conf += torch.bincount(y * len(CLASSES) + pred, minlength=len(CLASSES) ** 2).view_as(conf)
    dist.all_reduce(conf)
    recall = conf.diag().float() / conf.sum(1).clamp_min(1).float()
    return recall.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = T.Compose([T.RandomResizedCrop(args.img_size, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomVerticalFlip(), T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), T.Normalize(mean, std)])
    eval_tf = T.Compose([T.Resize(args.img_size), T.CenterCrop(args.img_size), T.ToTensor(), T.Normalize(mean, std)])
    df = pd.read_csv(args.csv)
    train_ds, eval_ds = ISIC(df, args.images, train_tf), ISIC(df, args.images, eval_tf)

    rng = np.random.RandomState(args.seed)
    perm = rng.permutation(len(df))
    n_test = int(args.test_frac * len(df))
    test_idx, pool_idx = np.sort(perm[:n_test]), perm[n_test:]
    labelled = np.sort(pool_idx[: args.init])

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        os.makedirs(args.work_dir, exist_ok=True)
    dist.barrier()

    for rnd in range(args.rounds):
        t0 = time.time()
        model = build_model(args.arch, len(CLASSES))
        model = DDP(model.to(device), device_ids=[local_rank])
        # class-weighted CE: ISIC is very imbalanced
        counts = np.bincount(train_ds.labels[labelled], minlength=len(CLASSES)) + 1
        weight = torch.tensor(counts.sum() / (len(CLASSES) * counts), dtype=torch.float32, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world / 8, weight_decay=1e-4)
        subset = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(subset, shuffle=True, seed=args.seed, drop_last=True)
        loader = DataLoader(subset, batch_size=args.bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * max(1, len(loader)))
        scaler = torch.cuda.amp.GradScaler()

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            model.train()
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y, weight=weight)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()

        bacc = balanced_accuracy(model.module, eval_ds, test_idx, device)

        unlabelled = np.setdiff1d(pool_idx, labelled)
        scores, ids = bald_scores(model.module, eval_ds, unlabelled, device, args.mc)
        query_file = os.path.join(args.work_dir, f"query_round{rnd:02d}.json")
        if rank == 0:
            ids_np, first = np.unique(ids.numpy(), return_index=True)
            order = np.argsort(-scores.numpy()[first])[: args.query]
            with open(query_file, "w") as f:
                json.dump(ids_np[order].tolist(), f)
            torch.save({"round": rnd, "model": model.module.state_dict(), "bacc": bacc,
                        "labelled": labelled.tolist()},
                       os.path.join(args.ckpt_dir, f"round{rnd:02d}.pth"))
            print(f"round {rnd} | labelled {len(labelled)} | test bal-acc {bacc:.4f} | "
                  f"{time.time() - t0:.0f}s", flush=True)
        dist.barrier()
        with open(query_file) as f:
            new = np.asarray(json.load(f), dtype=np.int64)
        labelled = np.union1d(labelled, new)
        del model, opt
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
