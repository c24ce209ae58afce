"""AI-generated image quality (AGIQA-3K): perceptual quality + text alignment.

Fine-tunes OpenCLIP ViT-B/16 end to end. Perception MOS is regressed from the
image embedding; alignment MOS from the scaled image-prompt cosine similarity.
Validation runs on rank 0 with the unwrapped model; training stops early when
the mean SRCC stops improving.

    torchrun --nproc_per_node=4 18_agiqa_clip_earlystop.py --root /data/AGIQA-3K --max-epochs 50
"""
import argparse
import os
import time

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class AGIQA(Dataset):
    def __init__(self, root, df, preprocess, tokenizer):
        self.root = root
        self.names = df["name"].tolist()
        self.tokens = tokenizer(df["prompt"].tolist())
        self.q = (df["mos_quality"].values / 5.0).astype(np.float32)
        self.a = (df["mos_align"].values / 5.0).astype(np.float32)
        self.preprocess = preprocess

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = self.preprocess(Image.open(os.path.join(self.root, "images", self.names[i])).convert("RGB"))
        return img, self.tokens[i], self.q[i], self.a[i]


class QualityAlignCLIP(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        self.clip = clip_model
        dim = clip_model.visual.output_dim
        self.q_head = nn.Sequential(nn.Linear(dim, 256), nn.GELU(), nn.Linear(256, 1))
        self.a_affine = nn.Linear(1, 1)

    def forward(self, images, tokens):
        img = F.normalize(self.clip.encode_image(images), dim=-1)
        txt = F.normalize(self.clip.encode_text(tokens), dim=-1)
        q = self.q_head(img).squeeze(-1)
        cos = (img * txt).sum(-1, keepdim=True) * self.clip.logit_scale.exp() / 100.0
        a = self.a_affine(cos).squeeze(-1)
        return q, a


def plcc_loss(x, y):
    x = x - x.mean()
    y = y - y.mean()
    return 1 - (x * y).sum() / (x.norm() * y.norm() + 1e-8)


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    qs, as_, gq, ga = [], [], [], []
    for img, tok, q, a in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pq, pa = net(img.to(device), tok.to(device))
        qs.append(pq.float().cpu())
        as_.append(pa.float().cpu())
        gq.append(q)
        ga.append(a)
    net.train()
    srcc_q = spearmanr(torch.cat(qs), torch.cat(gq))[0]
    srcc_a = spearmanr(torch.cat(as_), torch.cat(ga))[0]
    return srcc_q, srcc_a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="ViT-B-16")
    ap.add_argument("--pretrained", default="laion2b_s34b_b88k")
    ap.add_argument("--max-epochs", type=int, default=50)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--head-lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save", default="ckpts/agiqa_clip")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    clip_model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    df = pd.read_csv(os.path.join(args.root, "data.csv"))
    split = pd.read_csv(os.path.join(args.root, "split_official.csv"))  # name, split
    df = df.merge(split, on="name")
    train_ds = AGIQA(args.root, df[df["split"] == "train"], preprocess_train, tokenizer)
    val_ds = AGIQA(args.root, df[df["split"] == "val"], preprocess_val, tokenizer)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=args.workers) if rank == 0 else None

    model = QualityAlignCLIP(clip_model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.clip.parameters(), "lr": args.lr, "weight_decay": 0.1},
        {"params": list(model.module.q_head.parameters()) + list(model.module.a_affine.parameters()),
         "lr": args.head_lr, "weight_decay": 0.0},
    ])

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best, bad = -1.0, 0
    for epoch in range(args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for img, tok, q, a in loader:
            img, tok = img.to(device, non_blocking=True), tok.to(device, non_blocking=True)
            q, a = q.to(device), a.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pq, pa = model(img, tok)
            pq, pa = pq.float(), pa.float()
            loss_q = F.smooth_l1_loss(pq, q, beta=0.05) + plcc_loss(pq, q)
            loss_a = F.smooth_l1_loss(pa, a, beta=0.05) + plcc_loss(pa, a)
            loss = loss_q + loss_a
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            acc += torch.stack([loss_q.detach(), loss_a.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0:
            srcc_q, srcc_a = validate(model.module, val_loader, device)
            score = 0.5 * (srcc_q + srcc_a)
            print(f"epoch {epoch}: loss_q {acc[0] / acc[2]:.4f} loss_a {acc[1] / acc[2]:.4f} "
                  f"SRCC quality {srcc_q:.4f} alignment {srcc_a:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if score > best:
                best, bad = score, 0
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc_q": srcc_q,
                            "srcc_a": srcc_a}, os.path.join(args.save, "best.pt"))
            else:
                bad += 1
                if bad >= args.patience:
                    print(f"no improvement for {args.patience} epochs, stopping (best {best:.4f})")
                    break
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
