"""YouCook2 clip-level text-video retrieval: ResNet-50 frame encoder (SyncBN) + DistilBERT, trained from
ImageNet / pretrained-LM initialisation. Segment annotations are turned into a clip index once (rank 0).

    torchrun --nproc_per_node=8 18_youcook2_r50_distilbert.py --root /data/youcook2 --wandb_project yc2
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import wandb
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/youcook2")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--temp", type=float, default=0.05)
    ap.add_argument("--wandb_project", default=None)
    ap.add_argument("--out", default="/ckpt/yc2_r50")
    return ap.parse_args()


def build_clip_index(root, split, out_file):
    with open(os.path.join(root, "youcookii_annotations_trainval.json")) as f:
        db = json.load(f)["database"]
    subset = {"train": "training", "val": "validation"}[split]
    clips = []
    for vid, v in sorted(db.items()):
        if v["subset"] != subset:
            continue
        path = os.path.join(root, "raw_videos", subset, v["recipe_type"], vid + ".mp4")
        if not os.path.exists(path):
            continue
        for seg in v["annotations"]:
            clips.append({"path": path, "start": seg["segment"][0], "end": seg["segment"][1],
                          "sentence": seg["sentence"]})
    tmp = out_file + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(clips, f)
    os.replace(tmp, out_file)


class YouCookClips(Dataset):
    def __init__(self, index_file, frames, train):
        with open(index_file) as f:
            self.clips = json.load(f)
        self.frames, self.train = frames, train
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), antialias=True), norm]) if train else \
            T.Compose([T.Resize(224, antialias=True), T.CenterCrop(224), norm])

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        c = self.clips[i]
        vr = VideoReader(c["path"], ctx=cpu(0), num_threads=1, width=340, height=256)
        fps = vr.get_avg_fps()
        lo, hi = int(c["start"] * fps), max(int(c["start"] * fps) + 1, min(len(vr), int(c["end"] * fps)))
        edges = np.linspace(lo, hi, self.frames + 1).astype(int)
        if self.train:
            ids = [random.randint(a, max(a, b - 1)) for a, b in zip(edges[:-1], edges[1:])]
        else:
            ids = ((edges[:-1] + edges[1:]) // 2).tolist()
        ids = [min(k, len(vr) - 1) for k in ids]
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), c["sentence"], i


class Model(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        r50 = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
        r50.fc = nn.Identity()
        self.frame_encoder = r50
        self.video_head = nn.Sequential(nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
                                        nn.Linear(2048, dim))
        self.text_encoder = AutoModel.from_pretrained("distilbert-base-uncased")
        self.text_encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.text_head = nn.Linear(768, dim)

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = self.frame_encoder(x.flatten(0, 1)).view(b, t, -1).mean(1)
        return F.normalize(self.video_head(f), dim=-1)

    def encode_text(self, ids, mask):
        h = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        h = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(self.text_head(h), dim=-1)

    def forward(self, x, ids, mask):
        return self.encode_video(x), self.encode_text(ids, mask)


def gather_grad(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    parts[dist.get_rank()] = x
    return torch.cat(parts)


def gather_uneven(x):
    """all_gather for tensors whose first dim differs between ranks."""
    size = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    m = max(int(s) for s in sizes)
    padded = torch.zeros((m,) + x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    out = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s)] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, loader, tok, device):
    net.eval()
    vs, ts, ix = [], [], []
    for x, sents, idx in loader:
        enc = tok(list(sents), padding=True, truncation=True, max_length=48, return_tensors="pt").to(device)
        vs.append(net.encode_video(x.to(device)))
        ts.append(net.encode_text(enc.input_ids, enc.attention_mask))
        ix.append(idx.to(device))
    V, Tt, I = gather_uneven(torch.cat(vs)), gather_uneven(torch.cat(ts)), gather_uneven(torch.cat(ix))
    order = I.argsort()
    V, Tt = V[order], Tt[order]
    sim = Tt @ V.t()
    r = (sim > sim.diag()[:, None]).sum(1).float()
    net.train()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    index_files = {s: os.path.join(args.root, f"clip_index_{s}.json") for s in ("train", "val")}
    if rank == 0:
        for split, path in index_files.items():
            if not os.path.exists(path):
                build_clip_index(args.root, split, path)
    dist.barrier()
    train_set = YouCookClips(index_files["train"], args.frames, train=True)
    val_set = YouCookClips(index_files["val"], args.frames, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=10, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world))), 64, num_workers=10)
    tok = AutoTokenizer.from_pretrained("distilbert-base-uncased")

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)

    run = wandb.init(project=args.wandb_project, config=vars(args)) if rank == 0 and args.wandb_project else None
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, sents, _) in enumerate(train_loader):
            enc = tok(list(sents), padding="max_length", truncation=True, max_length=48, return_tensors="pt")
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t = model(x, enc.input_ids.to(device), enc.attention_mask.to(device))
            v, t = gather_grad(v.float()), gather_grad(t.float())
            logits = t @ v.t() / args.temp
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if run is not None and it % 20 == 0:
                run.log({"loss": loss.item(), "lr": sched.get_last_lr()[0], "epoch": epoch})

        res = evaluate(model.module, val_loader, tok, device)
        if rank == 0:
            print(f"epoch {epoch} val t2v {res}", flush=True)
            if run is not None:
                run.log({f"val/{k}": v for k, v in res.items()})
            if res["R@1"] > best:
                best = res["R@1"]
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": res},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()
    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
