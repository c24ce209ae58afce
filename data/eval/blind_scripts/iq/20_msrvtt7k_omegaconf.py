"""Text-video retrieval on MSR-VTT (7k train split), OpenCLIP ViT-B/16, configured with OmegaConf.

    torchrun --nproc_per_node=8 20_msrvtt7k_omegaconf.py config=configs/msrvtt7k.yaml train.lr=2e-6
"""
import json
import math
import os
import random
import sys
import time

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

BASE = OmegaConf.create({
    "data": {"root": "/data/msrvtt", "train_csv": "MSRVTT_train.7k.csv", "test_csv": "MSRVTT_JSFUSION_test.csv",
             "num_frames": 12, "workers": 8},
    "model": {"arch": "ViT-B-16", "pretrained": "openai"},
    "train": {"batch_size": 24, "epochs": 5, "lr": 1e-6, "wd": 0.2, "warmup": 0.1, "grad_clip": 1.0},
    "out_dir": "/ckpt/msrvtt7k_b16",
})


def load_cfg():
    cli = OmegaConf.from_cli(sys.argv[1:])
    cfg = BASE
    if "config" in cli:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(cli.pop("config")))
    return OmegaConf.merge(cfg, cli)


class MSRVTTData(Dataset):
    def __init__(self, dcfg, split, tokenizer):
        self.root, self.n, self.tok, self.train = dcfg.root, dcfg.num_frames, tokenizer, split == "train"
        if self.train:
            keep = set(pd.read_csv(os.path.join(dcfg.root, dcfg.train_csv))["video_id"])
            with open(os.path.join(dcfg.root, "MSRVTT_data.json")) as f:
                self.items = [(s["video_id"], s["caption"]) for s in json.load(f)["sentences"] if s["video_id"] in keep]
        else:
            df = pd.read_csv(os.path.join(dcfg.root, dcfg.test_csv))
            self.items = list(zip(df.video_id, df.sentence))
        norm = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
        self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.8, 1.0), antialias=True), T.RandomHorizontalFlip(),
                             norm]) if self.train else T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                                                                  norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, cap = self.items[i]
        vr = VideoReader(os.path.join(self.root, "videos", f"{vid}.mp4"), ctx=cpu(0), num_threads=1)
        e = np.linspace(0, len(vr), self.n + 1).astype(int)
        ids = [random.randint(a, max(a, b - 1)) for a, b in zip(e[:-1], e[1:])] if self.train \
            else ((e[:-1] + e[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), self.tok([cap])[0], i


class FrameMeanCLIP(nn.Module):
    def __init__(self, arch, pretrained):
        super().__init__()
        self.clip = open_clip.create_model(arch, pretrained=pretrained)

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.clip.encode_image(x.flatten(0, 1), normalize=True).view(b, t, -1)
        return F.normalize(f.mean(1), dim=-1)

    def encode_text(self, tok):
        return self.clip.encode_text(tok, normalize=True)

    def forward(self, x, tok):
        return self.encode_video(x), self.encode_text(tok), self.clip.logit_scale.exp()


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.lo = dist.get_rank() * x.shape[0]
        ctx.hi = ctx.lo + x.shape[0]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.lo:ctx.hi]


def sim_matrix_metrics(sim):
    r = (sim > sim.diag()[:, None]).sum(1).float()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1, "MnR": r.mean().item() + 1}


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    chunks = []
    for x, tok, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            v, t = net.encode_video(x.to(device)), net.encode_text(tok.to(device))
        chunks.append(torch.cat([v.float(), t.float(), idx.to(device).float()[:, None]], 1))
    local = torch.cat(chunks)
    bufs = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, local)
    allv = torch.cat(bufs)
    d = (local.shape[1] - 1) // 2
    emb = torch.zeros(n, 2 * d, device=device)
    emb[allv[:, -1].long()] = allv[:, :-1]
    net.train()
    t2v = sim_matrix_metrics(emb[:, d:] @ emb[:, :d].t())
    v2t = sim_matrix_metrics(emb[:, :d] @ emb[:, d:].t())
    return {"t2v": t2v, "v2t": v2t}


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    tokenizer = open_clip.get_tokenizer(cfg.model.arch)
    train_set = MSRVTTData(cfg.data, "train", tokenizer)
    test_set = MSRVTTData(cfg.data, "test", tokenizer)
    train_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, shuffle=True,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=32, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=cfg.data.workers, pin_memory=True)

    model = FrameMeanCLIP(cfg.model.arch, cfg.model.pretrained).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.train.lr, betas=(0.9, 0.98), eps=1e-6)
    total = cfg.train.epochs * len(train_loader)
    warm = int(cfg.train.warmup * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out_dir, "config.yaml"))
    best = 0.0
    for epoch in range(cfg.train.epochs):
        model.train()
        tic = time.time()
        for it, (x, tok, _) in enumerate(train_loader):
            x, tok = x.to(device, non_blocking=True), tok.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, scale = model(x, tok)
            v, t = AllGather.apply(v.float()), AllGather.apply(t.float())
            logits = scale * t @ v.t()
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.module.clip.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        res = evaluate(model.module, test_loader, len(test_set), device)
        if rank == 0:
            print(f"epoch {epoch} {json.dumps(res)}", flush=True)
            if res["t2v"]["R@1"] > best:
                best = res["t2v"]["R@1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": res},
                           os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
