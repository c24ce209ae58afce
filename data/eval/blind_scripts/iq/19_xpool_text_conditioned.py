"""X-Pool style text-conditioned frame pooling for text-video retrieval (MSR-VTT 9k / 1k-A).

    torchrun --nproc_per_node=4 19_xpool_text_conditioned.py --exp xpool_b32 --batch_size 32
"""
import argparse
import json
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import CLIPModel, CLIPTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--exp", default="xpool_b32")
parser.add_argument("--data", default="/data/msrvtt")
parser.add_argument("--save_root", default="/shared/ckpt")
parser.add_argument("--clip_arch", default="openai/clip-vit-base-patch32")
parser.add_argument("--num_frames", type=int, default=12)
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--clip_lr", type=float, default=1e-6)
parser.add_argument("--noclip_lr", type=float, default=1e-5)
parser.add_argument("--resume", action="store_true")


class MSRVTT(Dataset):
    def __init__(self, root, split, n_frames, tok):
        self.vdir, self.n, self.tok, self.train = os.path.join(root, "videos"), n_frames, tok, split == "train"
        if self.train:
            vids = set(pd.read_csv(os.path.join(root, "MSRVTT_train.9k.csv")).video_id)
            with open(os.path.join(root, "MSRVTT_data.json")) as f:
                self.data = [(s["video_id"], s["caption"]) for s in json.load(f)["sentences"] if s["video_id"] in vids]
        else:
            t = pd.read_csv(os.path.join(root, "MSRVTT_JSFUSION_test.csv"))
            self.data = list(zip(t.video_id, t.sentence))
        self.tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                             T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        vid, cap = self.data[i]
        vr = VideoReader(os.path.join(self.vdir, vid + ".mp4"), ctx=cpu(0), num_threads=1)
        acc = np.linspace(0, len(vr), self.n + 1).astype(int)
        if self.train:
            idx = [random.randint(a, max(a, b - 1)) for a, b in zip(acc[:-1], acc[1:])]
        else:
            idx = ((acc[:-1] + acc[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        enc = self.tok(cap, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
        return self.tf(x), enc.input_ids[0], enc.attention_mask[0], i


class XPool(nn.Module):
    def __init__(self, arch, embed_dim=512, dropout=0.3):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(arch)
        self.q = nn.Linear(embed_dim, embed_dim)
        self.k = nn.Linear(embed_dim, embed_dim)
        self.v = nn.Linear(embed_dim, embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(embed_dim, embed_dim))
        for m in (self.q, self.k, self.v, self.out):
            nn.init.eye_(m.weight)
            nn.init.zeros_(m.bias)

    def frames(self, video):
        b, t = video.shape[:2]
        return self.clip.get_image_features(pixel_values=video.flatten(0, 1)).view(b, t, -1)

    def text(self, ids, mask):
        return self.clip.get_text_features(input_ids=ids, attention_mask=mask)

    def pool(self, t, f):
        """t: [Nt, D] text, f: [Nv, T, D] frames -> [Nt, Nv, D] text-conditioned video embeddings."""
        t, f = self.ln1(t), self.ln1(f)
        q = self.q(t)                                               # Nt, D
        k, v = self.k(f), self.v(f)                                 # Nv, T, D
        att = torch.einsum("nd,mtd->nmt", q, k) / math.sqrt(q.shape[-1])
        pooled = torch.einsum("nmt,mtd->nmd", att.softmax(-1), v)
        pooled = self.ln2(self.out(pooled))
        return pooled + self.mlp(self.ln3(pooled))

    def logits(self, t, f, scale):
        pooled = F.normalize(self.pool(t, f), dim=-1)              # Nt, Nv, D
        return scale * torch.einsum("nd,nmd->nm", F.normalize(t, dim=-1), pooled)

    def forward(self, video, ids, mask):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            f, t = self.frames(video), self.text(ids, mask)
        f, t = all_gather_grad(f.float()), all_gather_grad(t.float())
        return self.logits(t, f, self.clip.logit_scale.exp())


def all_gather_grad(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts)


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    F_local, T_local, I_local = [], [], []
    for video, ids, mask, idx in loader:
        F_local.append(net.frames(video.to(device)))
        T_local.append(net.text(ids.to(device), mask.to(device)))
        I_local.append(idx.to(device))
    f, t, i = torch.cat(F_local), torch.cat(T_local), torch.cat(I_local)
    world = dist.get_world_size()
    fs, ts, is_ = ([torch.empty_like(z) for _ in range(world)] for z in (f, t, i))
    dist.all_gather(fs, f)
    dist.all_gather(ts, t)
    dist.all_gather(is_, i)
    Fa = torch.zeros((n,) + f.shape[1:], device=device)
    Ta = torch.zeros((n,) + t.shape[1:], device=device)
    Fa[torch.cat(is_)], Ta[torch.cat(is_)] = torch.cat(fs), torch.cat(ts)
    sims = torch.cat([net.logits(tc, Fa, 1.0) for tc in Ta.split(64)])
    r = (sims > sims.diag()[:, None]).sum(1).float()
    net.train()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1,
            "MnR": r.mean().item() + 1}


def save_checkpoint(path, model, opt, sched, epoch, best):
    torch.save({"state_dict": model.module.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": epoch, "best": best}, path)


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(24)
    random.seed(24 + rank)

    tok = CLIPTokenizer.from_pretrained(args.clip_arch)
    train_ds, test_ds = MSRVTT(args.data, "train", args.num_frames, tok), MSRVTT(args.data, "test", args.num_frames, tok)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, 32, sampler=DistributedSampler(test_ds, shuffle=False), num_workers=8)

    model = XPool(args.clip_arch).to(device)
    params = [{"params": [p for n, p in model.named_parameters() if n.startswith("clip.")], "lr": args.clip_lr},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("clip.")], "lr": args.noclip_lr}]
    opt = torch.optim.AdamW(params, weight_decay=0.2)
    total = len(train_dl) * args.epochs
    warm = int(0.1 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    save_dir = os.path.join(args.save_root, args.exp)
    os.makedirs(save_dir, exist_ok=True)
    start, best = 0, 0.0
    if args.resume and os.path.exists(os.path.join(save_dir, "model_latest.pth")):
        ck = torch.load(os.path.join(save_dir, "model_latest.pth"), map_location="cpu")
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start, best = ck["epoch"] + 1, ck["best"]
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (video, ids, mask, _) in enumerate(train_dl):
            video, ids, mask = video.to(device, non_blocking=True), ids.to(device), mask.to(device)
            logits = model(video, ids, mask)
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                model.module.clip.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_dl)}] loss {loss.item():.4f}", flush=True)

        res = evaluate(model.module, test_dl, len(test_ds), device)
        if rank == 0:
            print(f"epoch {epoch}: {res}", flush=True)
        if res["R@1"] > best:
            best = res["R@1"]
            save_checkpoint(os.path.join(save_dir, "model_best.pth"), model, opt, sched, epoch, best)
        save_checkpoint(os.path.join(save_dir, "model_latest.pth"), model, opt, sched, epoch, best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
