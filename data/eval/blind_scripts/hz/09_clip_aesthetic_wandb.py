"""CLIP ViT-L/14 aesthetic predictor (SAC + AVA ratings).

Partially fine-tunes the last vision transformer blocks of OpenCLIP ViT-L/14
together with an MLP head on mean aesthetic ratings (1-10). Loss: MSE plus a
listwise (ListMLE-like) term over the batch.

    torchrun --nproc_per_node=8 09_clip_aesthetic_wandb.py --train ratings/train.parquet \
        --val ratings/val.parquet --image-root /datasets/aesthetics
"""
import argparse
import math
import os

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RatingSet(Dataset):
    def __init__(self, parquet, root, preprocess):
        df = pd.read_parquet(parquet)
        self.paths = [os.path.join(root, p) for p in df["path"]]
        self.rating = df["rating"].values.astype(np.float32)
        self.preprocess = preprocess

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.preprocess(Image.open(self.paths[i]).convert("RGB")), self.rating[i], i


class AestheticCLIP(nn.Module):
    def __init__(self, clip_model, n_trainable_blocks):
        super().__init__()
        self.visual = clip_model.visual
        for p in self.visual.parameters():
            p.requires_grad_(False)
        for blk in self.visual.transformer.resblocks[-n_trainable_blocks:]:
            for p in blk.parameters():
                p.requires_grad_(True)
        for p in self.visual.ln_post.parameters():
            p.requires_grad_(True)
        self.visual.proj.requires_grad_(True)
        dim = self.visual.output_dim
        self.mlp = nn.Sequential(
            nn.Linear(dim, 1024), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(128, 1),
        )

    def forward(self, x):
        emb = F.normalize(self.visual(x), dim=-1)
        return self.mlp(emb).squeeze(-1)


def listmle(pred, target):
    order = torch.argsort(target, descending=True)
    s = pred[order]
    return (torch.logcumsumexp(s.flip(0), 0).flip(0) - s).mean()


@torch.no_grad()
def validate(model, loader, device, n):
    model.eval()
    buf = []
    for img, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = model(img.to(device, non_blocking=True))
        buf.append(torch.stack([p.float(), y.to(device), idx.to(device).float()], 1))
    buf = torch.cat(buf)
    allb = [torch.zeros_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(allb, buf)
    a = torch.cat(allb).cpu().numpy()
    _, keep = np.unique(a[:, 2].astype(np.int64), return_index=True)
    a = a[keep]
    assert len(a) == n
    model.train()
    return {"val/srcc": spearmanr(a[:, 0], a[:, 1])[0], "val/plcc": pearsonr(a[:, 0], a[:, 1])[0],
            "val/mse": float(((a[:, 0] - a[:, 1]) ** 2).mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--clip", default="ViT-L-14")
    ap.add_argument("--pretrained", default="openai")
    ap.add_argument("--trainable-blocks", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--list-weight", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output", default="checkpoints/clip_aesthetic")
    ap.add_argument("--wandb-project", default="aesthetics")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, config=vars(args), name=f"clip-aes-{args.clip}")

    clip_model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.clip, pretrained=args.pretrained)
    model = AestheticCLIP(clip_model, args.trainable_blocks).to(device)
    del clip_model

    train_ds = RatingSet(args.train, args.image_root, preprocess_train)
    val_ds = RatingSet(args.val, args.image_root, preprocess_val)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    model = DDP(model, device_ids=[local_rank])
    backbone = [p for p in model.module.visual.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([
        {"params": backbone, "lr": args.lr},
        {"params": model.module.mlp.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best, gstep = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for img, y, _ in loader:
            img = img.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(img)
            pred = pred.float()
            mse = F.mse_loss(pred, y)
            lm = listmle(pred, y)
            loss = mse + args.list_weight * lm
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            gstep += 1
            if gstep % 25 == 0:
                logs = torch.stack([mse.detach(), lm.detach()])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/mse": logs[0].item(), "train/listmle": logs[1].item(),
                               "lr": sched.get_last_lr()[0], "epoch": epoch}, step=gstep)

        metrics = validate(model, val_loader, device, len(val_ds))
        if rank == 0:
            wandb.log(metrics, step=gstep)
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            sd = {k: v for k, v in model.module.state_dict().items()}
            torch.save(sd, os.path.join(args.output, f"epoch{epoch}.pt"))
            if metrics["val/srcc"] > best:
                best = metrics["val/srcc"]
                torch.save(sd, os.path.join(args.output, "best.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
