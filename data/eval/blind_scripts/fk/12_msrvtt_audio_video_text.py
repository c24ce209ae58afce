#!/usr/bin/env python
"""Video+audio -> text retrieval on MSR-VTT with pre-extracted features.

Video: CLIP ViT-B/32 frame features (1 fps, variable length).
Audio: PANNs CNN14 embeddings per second; ~10% of MSR-VTT clips have no audio
track, those get a learned "missing audio" token.
Text:  frozen sentence-transformers backbone + trainable projection.

torchrun --nproc_per_node=4 12_msrvtt_audio_video_text.py --feats /data/msrvtt/feats --run-name avt_fusion_v3
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

MAX_T = 30


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--feats", required=True)
    p.add_argument("--split-train", default="train_9k.json")
    p.add_argument("--split-test", default="test_1k.json")
    p.add_argument("--text-model", default="sentence-transformers/all-mpnet-base-v2")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt-dir", default="checkpoints/avt")
    return p.parse_args()


class AVTFeatures(Dataset):
    def __init__(self, feat_root, split_file, train):
        with open(os.path.join(feat_root, split_file)) as f:
            self.items = json.load(f)  # [{"video_id", "captions": [...]}, ...]
        self.root = feat_root
        self.train = train

    def __len__(self):
        return len(self.items)

    @staticmethod
    def _pad(x):
        out = np.zeros((MAX_T, x.shape[1]), dtype=np.float32)
        n = min(len(x), MAX_T)
        out[:n] = x[:n]
        return torch.from_numpy(out), n

    def __getitem__(self, i):
        it = self.items[i]
        vid = np.load(os.path.join(self.root, "clip_b32", it["video_id"] + ".npy"))
        apath = os.path.join(self.root, "cnn14", it["video_id"] + ".npy")
        has_audio = os.path.exists(apath)
        aud = np.load(apath) if has_audio else np.zeros((1, 2048), dtype=np.float32)
        v, nv = self._pad(vid)
        a, na = self._pad(aud)
        cap = it["captions"][np.random.randint(len(it["captions"]))] if self.train else it["captions"][0]
        return v, nv, a, max(na, 1), has_audio, cap


def make_collate(tokenizer):
    def collate(batch):
        v, nv, a, na, has_a, caps = zip(*batch)
        tok = tokenizer(list(caps), padding=True, truncation=True, max_length=48, return_tensors="pt")
        return (torch.stack(v), torch.tensor(nv), torch.stack(a), torch.tensor(na),
                torch.tensor(has_a), tok["input_ids"], tok["attention_mask"])
    return collate


def masked_mean(x, n):
    m = (torch.arange(x.size(1), device=x.device)[None] < n[:, None]).unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp(min=1)


class AVTRetrieval(nn.Module):
    def __init__(self, text_model, dim):
        super().__init__()
        self.v_proj = nn.Sequential(nn.Linear(512, dim), nn.GELU(), nn.Linear(dim, dim))
        self.a_proj = nn.Sequential(nn.Linear(2048, dim), nn.GELU(), nn.Linear(dim, dim))
        self.missing_audio = nn.Parameter(torch.zeros(dim))
        self.gate = nn.Linear(2 * dim, 2)
        self.text = AutoModel.from_pretrained(text_model)
        self.text.requires_grad_(False)
        self.t_proj = nn.Linear(self.text.config.hidden_size, dim)
        self.log_tau = nn.Parameter(torch.tensor(math.log(0.05)))

    def encode_av(self, v, nv, a, na, has_a):
        ev = masked_mean(self.v_proj(v), nv)
        ea = masked_mean(self.a_proj(a), na)
        ea = torch.where(has_a[:, None], ea, self.missing_audio.expand_as(ea))
        w = self.gate(torch.cat([ev, ea], -1)).softmax(-1)
        return F.normalize(w[:, :1] * ev + w[:, 1:] * ea, dim=-1)

    def encode_text(self, ids, mask):
        with torch.no_grad():
            h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        h = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(self.t_proj(h), dim=-1)

    def forward(self, v, nv, a, na, has_a, ids, mask):
        return self.encode_av(v, nv, a, na, has_a), self.encode_text(ids, mask), self.log_tau.exp()


def gather_cat(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x  # keep the local slice in the graph
    return torch.cat(out)


def nce(av, t, tau):
    all_av, all_t = gather_cat(av), gather_cat(t)
    tgt = torch.arange(av.size(0), device=av.device) + dist.get_rank() * av.size(0)
    return 0.5 * (F.cross_entropy(t @ all_av.t() / tau, tgt) + F.cross_entropy(av @ all_t.t() / tau, tgt))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    E_av, E_t = [], []
    for v, nv, a, na, has_a, ids, mask in loader:
        v, nv, a, na, has_a = (x.to(device) for x in (v, nv, a, na, has_a))
        E_av.append(net.encode_av(v, nv, a, na, has_a))
        E_t.append(net.encode_text(ids.to(device), mask.to(device)))
    sim = torch.cat(E_t) @ torch.cat(E_av).t()
    res = {}
    for name, s in (("t2v", sim), ("v2t", sim.t())):
        r = (s > s.diag()[:, None]).sum(1) + 1
        res.update({f"{name}/R@{k}": (r <= k).float().mean().item() * 100 for k in (1, 5, 10)})
        res[f"{name}/MdR"] = r.float().median().item()
    net.train()
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    np.random.seed(42 + rank)

    wandb.init(project="msrvtt-avt", name=args.run_name, config={**vars(args), "world_size": world})

    tok = AutoTokenizer.from_pretrained(args.text_model)
    collate = make_collate(tok)
    train_set = AVTFeatures(args.feats, args.split_train, train=True)
    test_set = AVTFeatures(args.feats, args.split_test, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 250, shuffle=False, num_workers=8, collate_fn=collate)

    model = AVTRetrieval(args.text_model, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for v, nv, a, na, has_a, ids, mask in train_loader:
            v, nv, a, na, has_a = (x.to(device, non_blocking=True) for x in (v, nv, a, na, has_a))
            ids, mask = ids.to(device), mask.to(device)
            av, t, tau = model(v, nv, a, na, has_a, ids, mask)
            loss = nce(av, t, tau)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/tau": tau.item(),
                           "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        if rank == 0:
            res = evaluate(model.module, test_loader, device)
            res["epoch_time"] = time.time() - t0
            wandb.log(res, step=step)
            print(f"epoch {epoch}: " + " ".join(f"{k}={v:.2f}" for k, v in res.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.ckpt_dir, "last.pt"))
            if res["t2v/R@1"] > best:
                best = res["t2v/R@1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.ckpt_dir, "best.pt"))
                wandb.run.summary["best_t2v_R1"] = best
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
