"""SPAQ smartphone photo quality: MOS + image attributes (multi-task).

Predicts the overall MOS together with the five SPAQ attribute scores
(brightness, colorfulness, contrast, noisiness, sharpness). Long schedule on a
shared cluster, so it supports --resume from the last checkpoint.

    torchrun --nproc_per_node=8 06_spaq_multitask_resume.py --root /data/SPAQ \
        --resume work_dirs/spaq_mt/last.pth
"""
import argparse
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
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

ATTRS = ["Brightness", "Colorfulness", "Contrast", "Noisiness", "Sharpness"]


def get_args():
    parser = argparse.ArgumentParser("SPAQ multi-task")
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--arch", type=str, default="resnet50")
    parser.add_argument("--input-size", type=int, default=448)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--attr-weight", type=float, default=0.25)
    parser.add_argument("--num-workers", type=int, default=10)
    parser.add_argument("--work-dir", type=str, default="work_dirs/spaq_mt")
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--eval-every", type=int, default=2)
    return parser.parse_args()


class SPAQ(Dataset):
    def __init__(self, root, split, input_size, train):
        ann = pd.read_excel(os.path.join(root, "Annotations", "MOS and Image attribute scores.xlsx"))
        split_ids = set(pd.read_csv(os.path.join(root, f"{split}.txt"), header=None)[0])
        ann = ann[ann["Image name"].isin(split_ids)].reset_index(drop=True)
        self.paths = [os.path.join(root, "TestImage_resized", n) for n in ann["Image name"]]
        self.targets = (ann[["MOS"] + ATTRS].values / 100.0).astype(np.float32)
        if train:
            self.tf = transforms.Compose([
                transforms.RandomCrop(input_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ])
        else:
            self.tf = transforms.Compose([
                transforms.CenterCrop(input_size),
                transforms.ToTensor(),
                transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            ])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, idx):
        img = Image.open(self.paths[idx]).convert("RGB")
        return self.tf(img), torch.from_numpy(self.targets[idx]), idx


class MTQuality(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.encoder = timm.create_model(arch, pretrained=True, num_classes=0)
        dim = self.encoder.num_features
        self.mos_head = nn.Linear(dim, 1)
        self.attr_head = nn.Linear(dim, len(ATTRS))

    def forward(self, x):
        f = self.encoder(x)
        return torch.cat([self.mos_head(f), self.attr_head(f)], dim=1)


@torch.no_grad()
def run_eval(model, loader, device, n):
    model.eval()
    chunks = []
    for img, tgt, idx in loader:
        out = model(img.to(device, non_blocking=True)).float()
        chunks.append(torch.cat([out, tgt.to(device), idx.to(device).float()[:, None]], 1))
    local = torch.cat(chunks)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    arr = torch.cat(gathered).cpu().numpy()
    _, first = np.unique(arr[:, -1].astype(np.int64), return_index=True)
    arr = arr[first]
    assert arr.shape[0] == n
    k = 1 + len(ATTRS)
    pred, gt = arr[:, :k], arr[:, k:2 * k]
    res = {"srcc": spearmanr(pred[:, 0], gt[:, 0])[0], "plcc": pearsonr(pred[:, 0], gt[:, 0])[0]}
    for j, a in enumerate(ATTRS, start=1):
        res[f"srcc_{a.lower()}"] = spearmanr(pred[:, j], gt[:, j])[0]
    model.train()
    return res


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_set = SPAQ(args.root, "train", args.input_size, train=True)
    test_set = SPAQ(args.root, "test", args.input_size, train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler,
                             num_workers=args.num_workers, pin_memory=True)

    model = MTQuality(args.arch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_srcc = 0, -1.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_srcc = ckpt.get("best_srcc", -1.0)
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)
        del ckpt

    model = DistributedDataParallel(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        stats = torch.zeros(3, device=device)
        for img, tgt, _ in train_loader:
            img = img.to(device, non_blocking=True)
            tgt = tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
            out = out.float()
            mos_loss = F.mse_loss(out[:, 0], tgt[:, 0])
            attr_loss = F.mse_loss(out[:, 1:], tgt[:, 1:])
            loss = mos_loss + args.attr_weight * attr_loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            stats += torch.stack([mos_loss.detach(), attr_loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(stats)

        res = None
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = run_eval(model, test_loader, device, len(test_set))

        if rank == 0:
            msg = f"epoch {epoch} mos_mse {stats[0] / stats[2]:.5f} attr_mse {stats[1] / stats[2]:.5f} " \
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s"
            if res is not None:
                msg += " " + " ".join(f"{k}={v:.4f}" for k, v in res.items())
                if res["srcc"] > best_srcc:
                    best_srcc = res["srcc"]
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best.pth"))
            print(msg, flush=True)
            torch.save({
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "best_srcc": best_srcc,
            }, os.path.join(args.work_dir, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
