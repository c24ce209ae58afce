"""Bilinear-pooled VGG-16 quality model on KADID-10k, launched with mp.spawn.

KADID has 81 pristine references x 25 distortions x 5 levels. Train / test are
split by reference image (so test content is never seen in training), with a
fixed seed so the split is reproducible.

    python 16_kadid_bilinear_spawn.py --root /data/kadid10k --gpus 4
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models, transforms


def reference_split(df, seed, test_frac=0.2):
    refs = np.array(sorted(df["ref_img"].unique()))
    rng = np.random.RandomState(seed)
    rng.shuffle(refs)
    n_test = int(round(len(refs) * test_frac))
    test_refs = set(refs[:n_test])
    is_test = df["ref_img"].isin(test_refs)
    return df[~is_test].reset_index(drop=True), df[is_test].reset_index(drop=True)


class KADID(Dataset):
    def __init__(self, root, df, train):
        self.root = root
        self.files = df["dist_img"].tolist()
        self.dmos = ((df["dmos"].values - 1.0) / 4.0).astype(np.float32)
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.tf = transforms.Compose(
            ([transforms.RandomHorizontalFlip()] if train else []) + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "images", self.files[i])).convert("RGB")
        return self.tf(img), self.dmos[i]


class BilinearVGG(nn.Module):
    def __init__(self):
        super().__init__()
        vgg = models.vgg16(weights=models.VGG16_Weights.IMAGENET1K_V1)
        self.features = nn.Sequential(*list(vgg.features.children())[:-1])  # drop last max-pool
        self.fc = nn.Linear(512 * 512, 1)
        nn.init.kaiming_normal_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        f = self.features(x)
        b, c, h, w = f.shape
        f = f.view(b, c, h * w)
        g = torch.bmm(f, f.transpose(1, 2)) / (h * w)
        g = g.view(b, -1)
        g = torch.sign(g) * torch.sqrt(g.abs() + 1e-8)
        g = F.normalize(g, dim=1)
        return self.fc(g).squeeze(-1)


def test_on_rank0(net, loader, device):
    net.eval()
    preds, gts = [], []
    with torch.no_grad():
        for img, y in loader:
            preds.append(net(img.to(device, non_blocking=True)).float().cpu())
            gts.append(y)
    net.train()
    p, g = torch.cat(preds).numpy(), torch.cat(gts).numpy()
    return spearmanr(p, g)[0], pearsonr(p, g)[0]


def main_worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    df = pd.read_csv(os.path.join(args.root, "dmos.csv"))
    train_df, test_df = reference_split(df, args.seed)
    train_set, test_set = KADID(args.root, train_df, True), KADID(args.root, test_df, False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=32, shuffle=False, num_workers=args.workers) if rank == 0 else None

    net = BilinearVGG().to(device)
    # stage 1: only the bilinear head is trained, stage 2: everything
    for p in net.features.parameters():
        p.requires_grad_(args.stage == 2)
    if args.stage == 2 and args.init:
        state = torch.load(args.init, map_location=device)
        net.load_state_dict(state)
    model = DDP(net, device_ids=[rank])
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr if args.stage == 1 else args.lr * 0.1
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-8 if args.stage == 1 else 5e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    writer = SummaryWriter(os.path.join(args.out, f"stage{args.stage}")) if rank == 0 else None
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for img, y in loader:
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(img), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        # single-process evaluation of the full test split; other ranks wait at the broadcast
        srcc_t = torch.zeros(1, device=device)
        if rank == 0:
            srcc, plcc = test_on_rank0(model.module, test_loader, device)
            srcc_t[0] = srcc
            writer.add_scalar("loss", (loss_acc[0] / loss_acc[1]).item(), epoch)
            writer.add_scalar("srcc", srcc, epoch)
            writer.add_scalar("plcc", plcc, epoch)
            print(f"stage {args.stage} epoch {epoch}: loss {(loss_acc[0] / loss_acc[1]).item():.5f} "
                  f"SRCC {srcc:.4f} PLCC {plcc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if srcc > best:
                best = srcc
                torch.save(model.module.state_dict(), os.path.join(args.out, f"bcnn_stage{args.stage}.pth"))
        dist.broadcast(srcc_t, src=0)
        scheduler.step(srcc_t.item())   # identical LR decisions on every rank

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--stage", type=int, choices=[1, 2], default=1)
    ap.add_argument("--init", default="", help="stage-1 weights for stage 2")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="out/kadid_bcnn")
    return ap.parse_args()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(main_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
