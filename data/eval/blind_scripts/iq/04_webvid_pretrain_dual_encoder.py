"""Dual-encoder video-language pretraining on WebVid-2M (Frozen-in-Time flavour, frame-level ViT + DistilBERT),
with zero-shot MSR-VTT 1k-A retrieval after every epoch.

Launch (2 nodes x 8 GPUs, shared /mnt/fsx):
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
      04_webvid_pretrain_dual_encoder.py --webvid_root /mnt/fsx/webvid --msrvtt_root /mnt/fsx/msrvtt \
      --save_dir /mnt/fsx/exp/webvid_dual
"""
import argparse
import logging
import math
import os
import random

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--webvid_root", required=True)
    p.add_argument("--msrvtt_root", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--text_model", default="distilbert-base-uncased")
    p.add_argument("--video_model", default="vit_base_patch16_224")
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--embed_dim", type=int, default=256)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=12)
    return p.parse_args()


class VideoCaptionCSV(Dataset):
    def __init__(self, csv_file, video_fmt, frames, train):
        self.df = pd.read_csv(csv_file)
        self.video_fmt = video_fmt
        self.frames = frames
        self.train = train
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), antialias=True),
                                 T.RandomHorizontalFlip(), T.Normalize(MEAN, STD)])
        else:
            self.tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.df)

    def _read(self, row):
        vr = VideoReader(self.video_fmt.format(**row), ctx=cpu(0), num_threads=1)
        n = len(vr)
        ivs = [int(x) for x in torch.linspace(0, n, self.frames + 1)]
        if self.train:
            ids = [random.randrange(ivs[i], max(ivs[i] + 1, ivs[i + 1])) for i in range(self.frames)]
        else:
            ids = [(ivs[i] + ivs[i + 1]) // 2 for i in range(self.frames)]
        x = torch.from_numpy(vr.get_batch([min(i, n - 1) for i in ids]).asnumpy())
        return self.tf(x.permute(0, 3, 1, 2).float() / 255.0)

    def __getitem__(self, i):
        row = self.df.iloc[i].to_dict()
        try:
            video = self._read(row)
        except Exception as e:  # a few WebVid files are truncated
            if not self.train:
                raise
            log.warning("skip %s: %s", row.get("videoid"), e)
            return self[random.randrange(len(self))]
        return video, str(row["name"]), i


class DualEncoder(nn.Module):
    def __init__(self, video_model, text_model, dim, temperature):
        super().__init__()
        self.video = timm.create_model(video_model, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text_model)
        self.video_proj = nn.Linear(self.video.num_features, dim)
        self.text_proj = nn.Linear(self.text.config.hidden_size, dim)
        self.temperature = temperature

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.video(x.flatten(0, 1)).view(b, t, -1).mean(1)
        return F.normalize(self.video_proj(f), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        h = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return F.normalize(self.text_proj(h), dim=-1)

    def forward(self, video, input_ids, attention_mask):
        return self.encode_video(video), self.encode_text(input_ids, attention_mask)


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack(grads)
        dist.all_reduce(g)
        return g[dist.get_rank()]


def nce(v, t, temperature):
    v = torch.cat(GatherLayer.apply(v))
    t = torch.cat(GatherLayer.apply(t))
    sim = t @ v.t() / temperature
    y = torch.arange(sim.size(0), device=sim.device)
    return (F.cross_entropy(sim, y) + F.cross_entropy(sim.t(), y)) / 2


@torch.no_grad()
def zero_shot_msrvtt(model, loader, tokenizer, n, device):
    model.eval()
    feats = None
    for video, caps, idx in loader:
        enc = tokenizer(list(caps), padding=True, truncation=True, max_length=32, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            v = model.encode_video(video.to(device, non_blocking=True))
            t = model.encode_text(enc.input_ids, enc.attention_mask)
        local = torch.cat([idx.to(device)[:, None].float(), v.float(), t.float()], 1)
        parts = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        part = torch.cat(parts)
        if feats is None:
            feats = torch.zeros(n, local.shape[1] - 1, device=device)
        feats[part[:, 0].long()] = part[:, 1:]
    d = feats.shape[1] // 2
    sim = feats[:, d:] @ feats[:, :d].t()
    rank = (sim > sim.diag()[:, None]).sum(1)
    model.train()
    return {f"R@{k}": (rank < k).float().mean().item() * 100 for k in (1, 5, 10)} | {
        "MedR": rank.float().median().item() + 1}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.text_model)
    train_ds = VideoCaptionCSV(os.path.join(args.webvid_root, "results_2M_train.csv"),
                               os.path.join(args.webvid_root, "videos", "{page_dir}", "{videoid}.mp4"),
                               args.frames, train=True)
    val_ds = VideoCaptionCSV(os.path.join(args.msrvtt_root, "MSRVTT_JSFUSION_test.csv"),
                             os.path.join(args.msrvtt_root, "videos", "{video_id}.mp4"), args.frames, train=False)
    val_ds.df["name"] = val_ds.df["sentence"]
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=args.workers, pin_memory=True)

    model = DualEncoder(args.video_model, args.text_model, args.embed_dim, args.temperature).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    warmup = 2000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    start_epoch = 0
    last = os.path.join(args.save_dir, "last.pth")
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
        log.info("resumed from epoch %d", ck["epoch"])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (video, caps, _) in enumerate(train_dl):
            enc = tokenizer(list(caps), padding="max_length", truncation=True, max_length=32,
                            return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t = model(video.to(device, non_blocking=True), enc.input_ids, enc.attention_mask)
            loss = nce(v.float(), t.float(), args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_dl), loss.item(),
                         sched.get_last_lr()[0])

        res = zero_shot_msrvtt(model, val_dl, tokenizer, len(val_ds), device)
        log.info("epoch %d msrvtt t2v %s", epoch, res)
        if rank == 0:
            os.makedirs(args.save_dir, exist_ok=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "msrvtt": res}
            torch.save(ck, last + ".tmp")
            os.replace(last + ".tmp", last)
            torch.save(ck["model"], os.path.join(args.save_dir, f"model_ep{epoch:02d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
