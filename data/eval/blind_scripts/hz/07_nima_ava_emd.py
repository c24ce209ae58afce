"""NIMA-style aesthetic score distribution prediction on AVA.

Predicts the 10-bin rating histogram of each AVA photo and trains with the
squared EMD loss. Reported metrics: SRCC/PLCC of the predicted mean score and
binary accuracy at the 5.0 threshold, over the whole test split.

    torchrun --nproc_per_node=4 07_nima_ava_emd.py --ava-dir /data/AVA --accum 2
    # warm start from an older (DataParallel-era) checkpoint:
    torchrun --nproc_per_node=4 07_nima_ava_emd.py --ava-dir /data/AVA --init old/nima_dp.pth
"""
import argparse
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image, ImageFile
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import models
from torchvision import transforms as T

ImageFile.LOAD_TRUNCATED_IMAGES = True


class AVA(Dataset):
    """AVA.txt rows: idx, image_id, c1..c10, tags..., challenge_id"""

    def __init__(self, ava_dir, ids_file, train):
        keep = set(int(x) for x in open(os.path.join(ava_dir, ids_file)).read().split())
        self.ids, self.hist = [], []
        with open(os.path.join(ava_dir, "AVA.txt")) as f:
            for line in f:
                v = line.split()
                if int(v[1]) in keep:
                    h = np.array(v[2:12], dtype=np.float32)
                    self.ids.append(int(v[1]))
                    self.hist.append(h / h.sum())
        self.img_dir = os.path.join(ava_dir, "images")
        if train:
            self.tf = T.Compose([T.Resize((256, 256)), T.RandomCrop(224), T.RandomHorizontalFlip(),
                                 T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        else:
            self.tf = T.Compose([T.Resize((224, 224)), T.ToTensor(),
                                 T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, f"{self.ids[i]}.jpg")).convert("RGB")
        return self.tf(img), torch.from_numpy(self.hist[i]), i


def build_model():
    net = models.efficientnet_b2(weights=models.EfficientNet_B2_Weights.IMAGENET1K_V1)
    in_f = net.classifier[1].in_features
    net.classifier = nn.Sequential(nn.Dropout(0.3), nn.Linear(in_f, 10))
    return net


def emd_loss(logits, target, r=2):
    p = torch.softmax(logits, dim=1)
    cdf_p, cdf_t = torch.cumsum(p, 1), torch.cumsum(target, 1)
    return (torch.abs(cdf_p - cdf_t) ** r).mean(1).pow(1.0 / r).mean()


def mean_score(dist_):
    return (dist_ * torch.arange(1, 11, device=dist_.device, dtype=dist_.dtype)).sum(1)


@torch.no_grad()
def evaluate(model, loader, device, n_items):
    model.eval()
    rows = []
    for img, hist, idx in loader:
        p = torch.softmax(model(img.to(device, non_blocking=True)).float(), 1)
        h = hist.to(device)
        rows.append(torch.stack([mean_score(p), mean_score(h), idx.to(device).float()], 1))
    rows = torch.cat(rows)
    bucket = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(bucket, rows)
    allr = torch.cat(bucket).cpu().numpy()
    _, keep = np.unique(allr[:, 2].astype(np.int64), return_index=True)
    pred, gt = allr[keep, 0], allr[keep, 1]
    assert len(pred) == n_items
    acc = float(((pred >= 5.0) == (gt >= 5.0)).mean())
    return spearmanr(pred, gt)[0], pearsonr(pred, gt)[0], acc


def load_init(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    # checkpoints written from a DataParallel/DDP wrapper carry a "module." prefix
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ava-dir", required=True)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--init", default="")
    ap.add_argument("--out", default="runs/nima_ava")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = AVA(args.ava_dir, "train_ids.txt", train=True)
    test_ds = AVA(args.ava_dir, "test_ids.txt", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=128, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = build_model()
    if args.init:
        missing, unexpected = load_init(model, args.init)
        if rank == 0:
            print(f"init from {args.init}: missing={len(missing)} unexpected={len(unexpected)}")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD([
        {"params": model.module.features.parameters(), "lr": args.lr * 0.1},
        {"params": model.module.classifier.parameters(), "lr": args.lr},
    ], momentum=0.9, weight_decay=1e-4)
    updates_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * updates_per_epoch)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best = -1.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        acc_loss = torch.zeros((), device=device)
        for i, (img, hist, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            hist = hist.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            ctx = nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(img)
                loss = emd_loss(logits.float(), hist) / args.accum
                loss.backward()
            acc_loss += loss.detach()
            if boundary:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                global_step += 1
                if global_step % 50 == 0:
                    dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
                    if writer is not None:
                        writer.add_scalar("train/emd", acc_loss.item() / 50, global_step)
                    acc_loss.zero_()

        srcc, plcc, acc = evaluate(model, test_loader, device, len(test_ds))
        if rank == 0:
            writer.add_scalar("test/srcc", srcc, epoch)
            writer.add_scalar("test/plcc", plcc, epoch)
            writer.add_scalar("test/acc", acc, epoch)
            print(f"epoch {epoch}: SRCC {srcc:.4f} PLCC {plcc:.4f} acc {acc:.4f}", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            if srcc > best:
                best = srcc
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
