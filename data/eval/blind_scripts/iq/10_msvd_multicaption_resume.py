"""MSVD text-video retrieval with HF CLIP, auto-resume from the newest checkpoint in --ckpt_dir.

MSVD has ~40 captions per video. Training samples one caption per video per visit;
evaluation scores every test caption against the 670 test videos.

    torchrun --nproc_per_node=8 10_msvd_multicaption_resume.py --root /data/msvd --ckpt_dir /ckpt/msvd_b32
"""
import argparse
import glob
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
from transformers import CLIPModel, CLIPTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/msvd")
    p.add_argument("--ckpt_dir", default="/ckpt/msvd_b32")
    p.add_argument("--clip", default="openai/clip-vit-base-patch32")
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


TF = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])


def read_video(path, n_frames, train):
    vr = VideoReader(path, ctx=cpu(0), num_threads=1)
    n = len(vr)
    edges = torch.linspace(0, n, n_frames + 1).long().tolist()
    if train:
        ids = [random.randint(edges[i], max(edges[i], edges[i + 1] - 1)) for i in range(n_frames)]
    else:
        ids = [(edges[i] + edges[i + 1]) // 2 for i in range(n_frames)]
    ids = [min(i, n - 1) for i in ids]
    return TF(torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0)


class MSVDVideos(Dataset):
    def __init__(self, root, split, n_frames, tokenizer=None):
        with open(os.path.join(root, "raw-captions.pkl"), "rb") as f:
            captions = pickle.load(f)
        with open(os.path.join(root, f"{split}_list.txt")) as f:
            self.videos = [l.strip() for l in f if l.strip()]
        self.caps = [[" ".join(c) for c in captions[v]] for v in self.videos]
        self.root, self.n_frames, self.train, self.tok = root, n_frames, split == "train", tokenizer

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        video = read_video(os.path.join(self.root, "YouTubeClips", self.videos[i] + ".avi"), self.n_frames, self.train)
        if self.train:
            enc = self.tok(random.choice(self.caps[i]), padding="max_length", truncation=True, max_length=32,
                           return_tensors="pt")
            return video, enc.input_ids[0], enc.attention_mask[0]
        return video, i


class MSVDCaptions(Dataset):
    def __init__(self, videos: MSVDVideos, tokenizer):
        self.items = [(vi, c) for vi, caps in enumerate(videos.caps) for c in caps]
        self.tok = tokenizer

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vi, c = self.items[i]
        enc = self.tok(c, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
        return enc.input_ids[0], enc.attention_mask[0], i


class VideoCLIP(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)

    def encode_video(self, video):
        b, t = video.shape[:2]
        f = self.clip.get_image_features(pixel_values=video.flatten(0, 1)).view(b, t, -1)
        return F.normalize(F.normalize(f, dim=-1).mean(1), dim=-1)

    def encode_text(self, ids, mask):
        return F.normalize(self.clip.get_text_features(input_ids=ids, attention_mask=mask), dim=-1)

    def forward(self, video, ids, mask):
        return self.encode_video(video), self.encode_text(ids, mask), self.clip.logit_scale.exp()


class AllGatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.n = dist.get_rank(), x.size(0)
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


@torch.no_grad()
def gather_by_index(feats, idx, total, device):
    world = dist.get_world_size()
    fs = [torch.empty_like(feats) for _ in range(world)]
    ids = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(fs, feats)
    dist.all_gather(ids, idx)
    out = torch.zeros(total, feats.shape[1], device=device)
    out[torch.cat(ids)] = torch.cat(fs)
    return out


@torch.no_grad()
def evaluate(net, vid_loader, cap_loader, cap_to_vid, device):
    net.eval()
    v, vi = [], []
    for video, i in vid_loader:
        v.append(net.encode_video(video.to(device)))
        vi.append(i.to(device))
    t, ti = [], []
    for ids, mask, i in cap_loader:
        t.append(net.encode_text(ids.to(device), mask.to(device)))
        ti.append(i.to(device))
    V = gather_by_index(torch.cat(v), torch.cat(vi), len(vid_loader.dataset), device)
    Tt = gather_by_index(torch.cat(t), torch.cat(ti), len(cap_loader.dataset), device)
    net.train()
    gt = torch.tensor(cap_to_vid, device=device)
    ranks = []
    for chunk, g in zip(Tt.split(4096), gt.split(4096)):
        s = chunk @ V.t()
        ranks.append((s > s.gather(1, g[:, None])).sum(1))
    r = torch.cat(ranks).float()
    return {"R@1": (r < 1).float().mean().item() * 100, "R@5": (r < 5).float().mean().item() * 100,
            "R@10": (r < 10).float().mean().item() * 100, "MdR": r.median().item() + 1}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tok = CLIPTokenizer.from_pretrained(args.clip)
    train_set = MSVDVideos(args.root, "train", args.frames, tok)
    test_videos = MSVDVideos(args.root, "test", args.frames)
    test_caps = MSVDCaptions(test_videos, tok)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    vid_loader = DataLoader(test_videos, 32, sampler=DistributedSampler(test_videos, shuffle=False),
                            num_workers=args.workers)
    cap_loader = DataLoader(test_caps, 512, sampler=DistributedSampler(test_caps, shuffle=False), num_workers=2)

    model = VideoCLIP(args.clip).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.2)
    total = len(train_loader) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / (0.05 * total)) * 0.5 * (1 + math.cos(math.pi * s / total)))

    start_epoch, best = 0, 0.0
    ckpts = sorted(glob.glob(os.path.join(args.ckpt_dir, "epoch_*.pt")))
    if ckpts:
        state = torch.load(ckpts[-1])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        if rank == 0:
            print(f"resumed {ckpts[-1]} (epoch {state['epoch']}, best R@1 {best:.2f})", flush=True)
        del state
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (video, ids, mask) in enumerate(train_loader):
            video, ids, mask = video.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t, scale = model(video, ids, mask)
            v, t = AllGatherGrad.apply(v.float()), AllGatherGrad.apply(t.float())
            logits = scale * t @ v.t()
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        res = evaluate(model.module, vid_loader, cap_loader, [vi for vi, _ in test_caps.items], device)
        best = max(best, res["R@1"])
        if rank == 0:
            print(f"epoch {epoch} MSVD t2v {res} best {best:.2f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best, "metrics": res},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
