"""Paragraph-to-video retrieval on DiDeMo with a CLIP4Clip-style model (HF CLIP backbone).

All moment descriptions of a video are concatenated into one paragraph. Video metadata
(frame count, fps) is probed once and kept in a cache file next to the data.

  torchrun --nproc_per_node=8 05_didemo_paragraph_retrieval.py --root /data/didemo --max_frames 64
"""
import argparse
import json
import math
import os
import pickle
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from tqdm import tqdm
from transformers import CLIPModel, CLIPTokenizerFast


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/didemo")
    p.add_argument("--clip_name", default="openai/clip-vit-base-patch32")
    p.add_argument("--max_frames", type=int, default=64)
    p.add_argument("--max_words", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="work_dirs/didemo_b32")
    return p.parse_args()


def probe_videos(video_dir, names):
    meta = {}
    for name in tqdm(names, desc="probing videos"):
        path = os.path.join(video_dir, name)
        try:
            vr = VideoReader(path, ctx=cpu(0))
            meta[name] = {"frames": len(vr), "fps": float(vr.get_avg_fps())}
        except Exception:
            continue
    return meta


class DiDeMoParagraphs(Dataset):
    def __init__(self, root, split, tokenizer, max_frames, max_words, train):
        with open(os.path.join(root, "annotations", f"{split}_data.json")) as f:
            raw = json.load(f)
        paragraphs = {}
        for a in raw:
            paragraphs.setdefault(a["video"], []).append(a["description"].strip())
        video_dir = os.path.join(root, "videos")
        cache_file = os.path.join(root, "cache", f"{split}_video_meta.pkl")
        if os.path.exists(cache_file):
            with open(cache_file, "rb") as f:
                meta = pickle.load(f)
        else:
            meta = probe_videos(video_dir, sorted(paragraphs))
            os.makedirs(os.path.dirname(cache_file), exist_ok=True)
            with open(cache_file, "wb") as f:
                pickle.dump(meta, f)
        self.items = [(v, " ".join(p), meta[v]) for v, p in sorted(paragraphs.items()) if v in meta]
        self.video_dir = video_dir
        self.tok = tokenizer
        self.max_frames, self.max_words, self.train = max_frames, max_words, train
        self.tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                             T.Normalize((0.4815, 0.4578, 0.4082), (0.2686, 0.2613, 0.2758))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, text, meta = self.items[i]
        n = meta["frames"]
        # sample at most 1 frame per second, then pad with a mask
        step = max(1, int(round(meta["fps"])))
        ids = list(range(0, n, step))
        if len(ids) > self.max_frames:
            if self.train:
                ids = sorted(random.sample(ids, self.max_frames))
            else:
                ids = [ids[int(j)] for j in torch.linspace(0, len(ids) - 1, self.max_frames)]
        vr = VideoReader(os.path.join(self.video_dir, name), ctx=cpu(0), num_threads=1)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        x = self.tf(x)
        mask = torch.zeros(self.max_frames, dtype=torch.bool)
        mask[: len(ids)] = True
        x = torch.cat([x, x.new_zeros(self.max_frames - len(ids), *x.shape[1:])])
        enc = self.tok(text, max_length=self.max_words, truncation=True, padding="max_length", return_tensors="pt")
        return x, mask, enc.input_ids[0], enc.attention_mask[0], i


class ParagraphCLIP(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)

    def encode_text(self, ids, att):
        return F.normalize(self.clip.get_text_features(input_ids=ids, attention_mask=att), dim=-1)

    def encode_video(self, x, mask):
        b, t = x.shape[:2]
        # only run the image tower on real frames
        f = self.clip.get_image_features(pixel_values=x[mask])
        out = f.new_zeros(b, t, f.shape[-1])
        out[mask] = f
        m = mask.unsqueeze(-1).to(out.dtype)
        return F.normalize((out * m).sum(1) / m.sum(1), dim=-1)

    def forward(self, x, mask, ids, att):
        return self.encode_video(x, mask), self.encode_text(ids, att), self.clip.logit_scale.exp()


def gather(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    out[dist.get_rank()] = x
    return torch.cat(out)


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    feats = []
    for x, mask, ids, att, idx in loader:
        x, mask, ids, att = x.to(device), mask.to(device), ids.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            v, t = net.encode_video(x, mask), net.encode_text(ids, att)
        feats.append(torch.cat([idx.to(device).unsqueeze(1).float(), v.float(), t.float()], 1))
    local = torch.cat(feats)
    allf = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(allf, local)
    allf = torch.cat(allf)
    table = torch.zeros(n, local.shape[1] - 1, device=device)
    table[allf[:, 0].long()] = allf[:, 1:]
    d = table.shape[1] // 2
    sim = table[:, d:] @ table[:, :d].t()
    r = (sim > sim.diag().unsqueeze(1)).sum(1).float()
    net.train()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = CLIPTokenizerFast.from_pretrained(args.clip_name)
    train_set = DiDeMoParagraphs(args.root, "train", tok, args.max_frames, args.max_words, train=True)
    test_set = DiDeMoParagraphs(args.root, "test", tok, args.max_frames, args.max_words, train=False)
    tr_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 16, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = DDP(ParagraphCLIP(args.clip_name).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
    total = len(train_loader) * args.epochs
    warm = max(1, int(0.1 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for it, (x, mask, ids, att, _) in enumerate(train_loader):
            x, mask = x.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, s = model(x, mask, ids, att)
            v, t = gather(v.float()), gather(t.float())
            logits = s * t @ v.t()
            y = torch.arange(len(logits), device=device)
            loss = 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"ep{epoch} {it}/{len(train_loader)} loss {loss.item():.4f} scale {s.item():.2f}", flush=True)

        res = evaluate(model.module, test_loader, len(test_set), device)
        if rank == 0:
            print(f"epoch {epoch} paragraph->video {res}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            if res["R@1"] > best:
                best = res["R@1"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
