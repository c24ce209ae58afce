"""LSMDC text-to-video retrieval (CLIP4Clip meanP / seqTransf), single node, processes started with mp.spawn.

    python 07_lsmdc_mp_spawn.py --gpus 4 --sim_header meanP --init_from pretrained/clip4clip_msrvtt_meanP.bin
"""
import argparse
import csv
import math
import os
import random
from collections import OrderedDict

import clip
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/lsmdc")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", default="29511")
    p.add_argument("--backbone", default="ViT-B/32")
    p.add_argument("--sim_header", choices=["meanP", "seqTransf"], default="meanP")
    p.add_argument("--init_from", default="")
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-7)
    p.add_argument("--coef_lr", type=float, default=1e3)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="ckpts/lsmdc")
    return p


class LSMDC(Dataset):
    tf = T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224),
                    T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    def __init__(self, root, split, frames):
        ann = {"train": "LSMDC16_annos_training.csv", "test": "LSMDC16_challenge_1000_publictect.csv"}[split]
        self.items = []
        with open(os.path.join(root, ann)) as f:
            for row in csv.reader(f, delimiter="\t"):
                clip_id, sentence = row[0], row[-1]
                movie = clip_id[: clip_id.rfind("_")]
                path = os.path.join(root, "avi", movie, clip_id + ".avi")
                if os.path.exists(path):
                    self.items.append((path, sentence))
        self.frames, self.train = frames, split == "train"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, sentence = self.items[i]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n = len(vr)
        if self.train:
            ids = sorted(random.sample(range(n), self.frames)) if n >= self.frames else list(range(n))
        else:
            ids = np.linspace(0, n - 1, self.frames).astype(int).tolist()
        ids += [ids[-1]] * (self.frames - len(ids))
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), clip.tokenize(sentence, truncate=True)[0]


class CLIP4Clip(nn.Module):
    def __init__(self, backbone, sim_header, frames):
        super().__init__()
        self.clip, _ = clip.load(backbone, device="cpu", jit=False)
        self.clip.float()
        self.sim_header = sim_header
        w = self.clip.text_projection.shape[1]
        # built for both headers so that checkpoints load either way
        self.frame_position_embeddings = nn.Embedding(frames, w)
        self.transformerClip = nn.TransformerEncoder(nn.TransformerEncoderLayer(w, w // 64, 4 * w, batch_first=True), 4)

    def encode_text(self, tokens):
        return F.normalize(self.clip.encode_text(tokens), dim=-1)

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.clip.encode_image(x.flatten(0, 1)).view(b, t, -1)
        if self.sim_header == "seqTransf":
            pos = self.frame_position_embeddings(torch.arange(t, device=x.device))
            f = f + self.transformerClip(f + pos)
        return F.normalize(F.normalize(f, dim=-1).mean(1), dim=-1)

    def forward(self, x, tokens):
        return self.encode_video(x), self.encode_text(tokens), self.clip.logit_scale.exp()


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank, world):
        ctx.rank, ctx.bs = rank, x.shape[0]
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank * ctx.bs:(ctx.rank + 1) * ctx.bs], None, None


def load_pretrained(model, path, device):
    sd = torch.load(path, map_location=device)
    sd = sd.get("state_dict", sd)
    sd = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in sd.items())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    return missing, unexpected


@torch.no_grad()
def evaluate(net, dataset, device):
    loader = DataLoader(dataset, batch_size=64, num_workers=6)
    net.eval()
    vs, ts = [], []
    for x, tok in loader:
        vs.append(net.encode_video(x.to(device)))
        ts.append(net.encode_text(tok.to(device)))
    sim = torch.cat(ts) @ torch.cat(vs).t()
    net.train()
    ranks = (sim > sim.diag()[:, None]).sum(1).float()
    return {f"R@{k}": 100 * (ranks < k).float().mean().item() for k in (1, 5, 10)} | {"MdR": ranks.median().item() + 1}


def worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=gpu)
    device = torch.device("cuda", gpu)
    random.seed(gpu)
    torch.manual_seed(0)

    model = CLIP4Clip(args.backbone, args.sim_header, args.frames)
    if args.init_from:
        missing, unexpected = load_pretrained(model, args.init_from, "cpu")
        if gpu == 0:
            print(f"init from {args.init_from}: {len(missing)} missing, {len(unexpected)} unexpected")
    model.to(device)
    ddp = DDP(model, device_ids=[gpu], find_unused_parameters=args.sim_header == "meanP")

    train_set = LSMDC(args.data, "train", args.frames)
    sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True)
    loader = DataLoader(train_set, args.batch_size // ngpus, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    clip_p = [p for n, p in model.named_parameters() if n.startswith("clip.")]
    head_p = [p for n, p in model.named_parameters() if not n.startswith("clip.")]
    opt = torch.optim.Adam([{"params": clip_p, "lr": args.lr}, {"params": head_p, "lr": args.lr * args.coef_lr}])
    total = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / (0.1 * total)) if s < 0.1 * total
                                              else 0.5 * (1 + math.cos(math.pi * s / total)))

    test_set = LSMDC(args.data, "test", args.frames) if gpu == 0 else None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (x, tok) in enumerate(loader):
            x, tok = x.to(device, non_blocking=True), tok.to(device, non_blocking=True)
            v, t, scale = ddp(x, tok)
            v, t = AllGather.apply(v, gpu, ngpus), AllGather.apply(t, gpu, ngpus)
            sim = scale * t @ v.t()
            y = torch.arange(sim.shape[0], device=device)
            loss = (F.cross_entropy(sim, y) + F.cross_entropy(sim.t(), y)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if gpu == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(loader)}] loss {loss.item():.4f}", flush=True)
        if gpu == 0:
            res = evaluate(model, test_set, device)
            print(f"epoch {epoch} LSMDC t2v {res}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, f"pytorch_model.bin.{epoch}"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    mp.spawn(worker, nprocs=args.gpus, args=(args.gpus, args))
