"""Paragraph-to-video retrieval on DiDeMo with a CLIP ViT-B/16 backbone.

All captions of a video are concatenated into one paragraph. Frames are decoded
on the fly with decord (videos are 25-30 s but vary), 12 frames per clip, and a
small temporal transformer sits on top of the per-frame CLS embeddings.

    torchrun --nproc_per_node=8 08_didemo_paragraph_retrieval.py --root /data/didemo
"""
import argparse
import contextlib
import json
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPTextModelWithProjection, CLIPTokenizerFast, CLIPVisionModelWithProjection

decord.bridge.set_bridge("torch")
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--clip", default="openai/clip-vit-base-patch16")
    p.add_argument("--frames", type=int, default=12)
    p.add_argument("--max-words", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=1e-6, help="for a global batch of 256")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--freeze-text-layers", type=int, default=6)
    p.add_argument("--out", default="work_dirs/didemo_seqtransf")
    p.add_argument("--resume", default="")
    return p.parse_args()


class DiDeMo(Dataset):
    def __init__(self, root, split, tokenizer, n_frames, max_words, train):
        with open(os.path.join(root, f"{split}_data.json")) as f:
            rows = json.load(f)
        paras = {}
        for r in rows:
            paras.setdefault(r["video"], []).append(r["description"].strip())
        self.videos = sorted(paras)
        self.paras = [" ".join(paras[v]) for v in self.videos]
        self.video_dir = os.path.join(root, "videos")
        self.tok, self.n_frames, self.max_words, self.train = tokenizer, n_frames, max_words, train

    def __len__(self):
        return len(self.videos)

    def load_frames(self, path):
        vr = decord.VideoReader(path, width=224, height=224, num_threads=1)
        n = len(vr)
        bounds = np.linspace(0, n, self.n_frames + 1).astype(int)
        if self.train:
            idx = [random.randint(a, max(a, b - 1)) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            idx = ((bounds[:-1] + bounds[1:]) // 2).tolist()
        frames = vr.get_batch([min(i, n - 1) for i in idx]).permute(0, 3, 1, 2).float() / 255.0
        return (frames - MEAN) / STD

    def __getitem__(self, i):
        frames = self.load_frames(os.path.join(self.video_dir, self.videos[i]))
        t = self.tok(self.paras[i], max_length=self.max_words, truncation=True, padding="max_length",
                     return_tensors="pt")
        return frames, t.input_ids[0], t.attention_mask[0], i


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient flowing back to each rank's own slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack(grads)
        dist.all_reduce(g)
        return g[dist.get_rank()]


class CLIPSeqTransf(nn.Module):
    def __init__(self, name, n_frames, freeze_text_layers):
        super().__init__()
        self.vision = CLIPVisionModelWithProjection.from_pretrained(name)
        self.text = CLIPTextModelWithProjection.from_pretrained(name)
        dim = self.vision.config.projection_dim
        self.frame_pos = nn.Embedding(n_frames, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.temporal = nn.TransformerEncoder(layer, 4)
        self.logit_scale = nn.Parameter(torch.tensor(np.log(100.0), dtype=torch.float32))
        # lower text layers stay frozen (no grad -> not registered with DDP's reducer)
        for p in self.text.text_model.embeddings.parameters():
            p.requires_grad_(False)
        for layer in self.text.text_model.encoder.layers[:freeze_text_layers]:
            for p in layer.parameters():
                p.requires_grad_(False)

    def encode_video(self, frames):
        b, t = frames.shape[:2]
        f = self.vision(pixel_values=frames.flatten(0, 1)).image_embeds.view(b, t, -1)
        h = f + self.frame_pos.weight[:t]
        h = self.temporal(h) + f
        return F.normalize(h.mean(1), dim=-1)

    def encode_text(self, ids, mask):
        return F.normalize(self.text(input_ids=ids, attention_mask=mask).text_embeds, dim=-1)

    def forward(self, frames, ids, mask):
        return self.encode_video(frames), self.encode_text(ids, mask), self.logit_scale.exp()


def clip_loss(v, t, scale):
    all_v = torch.cat(GatherLayer.apply(v))
    all_t = torch.cat(GatherLayer.apply(t))
    labels = torch.arange(v.size(0), device=v.device) + dist.get_rank() * v.size(0)
    return (F.cross_entropy(scale * t @ all_v.t(), labels) + F.cross_entropy(scale * v @ all_t.t(), labels)) / 2


def retrieval_metrics(sim):
    gt = sim.diag().unsqueeze(1)
    ranks = (sim > gt).sum(1) + 1
    r = {f"R@{k}": 100.0 * (ranks <= k).float().mean().item() for k in (1, 5, 10, 50)}
    r["MedR"] = ranks.float().median().item()
    return r


@torch.no_grad()
def evaluate(net, loader, device, n_total):
    net.eval()
    vs, ts, idx = [], [], []
    for frames, ids, mask, i in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            vs.append(net.encode_video(frames.to(device, non_blocking=True)).float())
            ts.append(net.encode_text(ids.to(device), mask.to(device)).float())
        idx.append(i.to(device))
    v, t, idx = torch.cat(vs), torch.cat(ts), torch.cat(idx)
    # DistributedSampler pads every shard to the same length, so the shapes match
    world = dist.get_world_size()
    gv = [torch.empty_like(v) for _ in range(world)]
    gt = [torch.empty_like(t) for _ in range(world)]
    gi = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(gv, v)
    dist.all_gather(gt, t)
    dist.all_gather(gi, idx)
    v, t, idx = torch.cat(gv), torch.cat(gt), torch.cat(gi)
    # drop the padded duplicates and restore dataset order
    V = torch.zeros(n_total, v.size(1), device=device)
    T = torch.zeros(n_total, t.size(1), device=device)
    V[idx], T[idx] = v, t
    sim = T @ V.t()
    net.train()
    return retrieval_metrics(sim), retrieval_metrics(sim.t())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)
    random.seed(2024 + rank)

    tok = CLIPTokenizerFast.from_pretrained(args.clip)
    train_set = DiDeMo(args.root, "train", tok, args.frames, args.max_words, True)
    test_set = DiDeMo(args.root, "test", tok, args.frames, args.max_words, False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 32, sampler=test_sampler, num_workers=10, pin_memory=True)

    net = CLIPSeqTransf(args.clip, args.frames, args.freeze_text_layers).to(device)
    if args.resume:
        net.load_state_dict(torch.load(args.resume, map_location="cpu")["model"])
    model = DDP(net, device_ids=[local_rank])

    global_batch = args.batch_size * world * args.accum
    lr = args.base_lr * global_batch / 256
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.2)
    steps = args.epochs * (len(train_loader) // args.accum)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1,
                                                anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, global batch {global_batch}, lr {lr:.2e}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        n_micro = (len(train_loader) // args.accum) * args.accum
        for it, (frames, ids, mask, _) in enumerate(train_loader):
            if it >= n_micro:
                break
            frames, ids, mask = frames.to(device, non_blocking=True), ids.to(device), mask.to(device)
            sync_now = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not sync_now else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    v, t, scale = model(frames, ids, mask)
                loss = clip_loss(v.float(), t.float(), scale.float().clamp(max=100)) / args.accum
                scaler.scale(loss).backward()
            if sync_now:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item() * args.accum:.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        t2v, v2t = evaluate(net, test_loader, device, len(test_set))
        if rank == 0:
            print(f"epoch {epoch} | text->video {t2v} | video->text {v2t}", flush=True)
            ckpt = {"model": net.state_dict(), "epoch": epoch, "t2v": t2v}
            torch.save(ckpt, os.path.join(args.out, "latest.pth"))
            if t2v["R@1"] > best:
                best = t2v["R@1"]
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
