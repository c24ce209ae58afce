"""MSR-VTT text-to-video retrieval trainer (CLIP ViT-B/16 + temporal transformer).

    torchrun --nproc_per_node=8 06_msrvtt_trainer_class.py --exp_name b16_tt --epochs 5
"""
import argparse
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


@dataclass
class Config:
    exp_name: str = "b16"
    data_dir: str = "/datasets/msrvtt"
    arch: str = "ViT-B-16"
    pretrained: str = "openai"
    frames: int = 12
    words: int = 32
    batch_size: int = 16
    epochs: int = 5
    lr: float = 1e-6
    temporal_lr: float = 1e-4
    temporal_layers: int = 4
    workers: int = 8
    seed: int = 0
    log_root: str = "/checkpoints/msrvtt"


def get_config():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        ap.add_argument(f"--{f.name}", type=f.type, default=f.default)
    return Config(**vars(ap.parse_args()))


class MSRVTT(Dataset):
    def __init__(self, cfg, split, tokenizer):
        self.dir = os.path.join(cfg.data_dir, "videos")
        self.frames, self.train, self.tok = cfg.frames, split == "train", tokenizer
        if self.train:
            vids = set(pd.read_csv(os.path.join(cfg.data_dir, "MSRVTT_train.9k.csv"))["video_id"])
            with open(os.path.join(cfg.data_dir, "MSRVTT_data.json")) as f:
                sents = json.load(f)["sentences"]
            self.pairs = [(s["video_id"], s["caption"]) for s in sents if s["video_id"] in vids]
        else:
            df = pd.read_csv(os.path.join(cfg.data_dir, "MSRVTT_JSFUSION_test.csv"))
            self.pairs = list(zip(df["video_id"], df["sentence"]))
        norm = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
        self.tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224), norm])

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        vid, cap = self.pairs[i]
        vr = VideoReader(os.path.join(self.dir, f"{vid}.mp4"), ctx=cpu(0), num_threads=1)
        seg = np.linspace(0, len(vr), self.frames + 1).astype(int)
        if self.train:
            ids = [random.randint(seg[k], max(seg[k], seg[k + 1] - 1)) for k in range(self.frames)]
        else:
            ids = ((seg[:-1] + seg[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), self.tok([cap])[0]


class TemporalCLIP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.clip = open_clip.create_model(cfg.arch, pretrained=cfg.pretrained)
        d = self.clip.text_projection.shape[1]
        self.pos = nn.Parameter(torch.zeros(1, cfg.frames, d))
        self.temporal = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True), cfg.temporal_layers)

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.clip.encode_image(x.flatten(0, 1)).view(b, t, -1)
        f = f + self.temporal(f + self.pos[:, :t])
        return F.normalize(f.mean(1), dim=-1)

    def encode_text(self, tokens):
        return F.normalize(self.clip.encode_text(tokens), dim=-1)

    def forward(self, x, tokens):
        return self.encode_video(x), self.encode_text(tokens), self.clip.logit_scale.exp()


class GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n, ctx.r = x.shape[0], dist.get_rank()
        buf = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(buf, x)
        return torch.cat(buf)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.r * ctx.n:(ctx.r + 1) * ctx.n]


def retrieval_metrics(sim):
    order = torch.argsort(sim, dim=1, descending=True)
    gt = torch.arange(sim.shape[0], device=sim.device)[:, None]
    rank = (order == gt).float().argmax(1)
    return {"R@1": 100 * (rank < 1).float().mean().item(),
            "R@5": 100 * (rank < 5).float().mean().item(),
            "R@10": 100 * (rank < 10).float().mean().item(),
            "MdR": rank.float().median().item() + 1,
            "MnR": rank.float().mean().item() + 1}


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.main = self.rank == 0
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed + self.rank)

        tokenizer = open_clip.get_tokenizer(cfg.arch)
        self.train_set, self.test_set = MSRVTT(cfg, "train", tokenizer), MSRVTT(cfg, "test", tokenizer)
        self.train_sampler = DistributedSampler(self.train_set, shuffle=True, seed=cfg.seed)
        self.train_loader = DataLoader(self.train_set, cfg.batch_size, sampler=self.train_sampler,
                                       num_workers=cfg.workers, pin_memory=True, drop_last=True)
        self.test_loader = DataLoader(self.test_set, 32, sampler=DistributedSampler(self.test_set, shuffle=False),
                                      num_workers=cfg.workers, pin_memory=True)

        model = TemporalCLIP(cfg).to(self.device)
        groups = [{"params": [p for n, p in model.named_parameters() if n.startswith("clip.")], "lr": cfg.lr},
                  {"params": [p for n, p in model.named_parameters() if not n.startswith("clip.")],
                   "lr": cfg.temporal_lr}]
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(groups, weight_decay=0.2)
        self.total = cfg.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min((s + 1) / (0.1 * self.total), 0.5 * (1 + math.cos(math.pi * s / self.total))))
        self.scaler = torch.cuda.amp.GradScaler()
        self.log_dir = os.path.join(cfg.log_root, cfg.exp_name)
        self.writer = SummaryWriter(self.log_dir) if self.main else None
        self.step = 0

    def train_epoch(self, epoch):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x, tok in self.train_loader:
            x, tok = x.to(self.device, non_blocking=True), tok.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, scale = self.model(x, tok)
            v, t = GatherWithGrad.apply(v.float()), GatherWithGrad.apply(t.float())
            logits = scale * t @ v.t()
            y = torch.arange(logits.shape[0], device=self.device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.step += 1
            if self.main and self.step % 50 == 0:
                self.writer.add_scalar("train/loss", loss.item(), self.step)
                self.writer.add_scalar("train/logit_scale", scale.item(), self.step)
                print(f"[{epoch}] step {self.step}/{self.total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()

    @torch.no_grad()
    def evaluate(self):
        net = self.model.module
        net.eval()
        vs, ts = [], []
        for x, tok in self.test_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                vs.append(net.encode_video(x.to(self.device)).float())
                ts.append(net.encode_text(tok.to(self.device)).float())
        sim = torch.cat(ts) @ torch.cat(vs).t()
        return retrieval_metrics(sim)

    def save(self, name, epoch, metrics):
        torch.save({"model": self.model.module.state_dict(), "epoch": epoch, "metrics": metrics,
                    "config": dataclasses.asdict(self.cfg)}, os.path.join(self.log_dir, name))

    def fit(self):
        best = -1.0
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            metrics = self.evaluate()
            if self.main:
                print(f"epoch {epoch} t2v: " + " ".join(f"{k} {v:.2f}" for k, v in metrics.items()), flush=True)
                for k, v in metrics.items():
                    self.writer.add_scalar(f"test/{k}", v, epoch)
                self.save("last.pth", epoch, metrics)
                if metrics["R@1"] > best:
                    best = metrics["R@1"]
                    self.save("best.pth", epoch, metrics)
            dist.barrier()
        if self.main:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(get_config()).fit()
