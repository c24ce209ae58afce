"""Paragraph-to-video retrieval on ActivityNet Captions (val_1 as test).

Long untrimmed videos: pre-extracted I3D (rgb+flow, 2048-d) and VGGish audio (128-d)
features at ~1.5 s per step, truncated / uniformly resampled to --max-steps.
Video and paragraph are each encoded with a small transformer; the paragraph
side starts from frozen GloVe-initialised word embeddings.

    torchrun --nproc_per_node=8 18_activitynet_paragraph_retrieval.py --data /data/anet
"""
import argparse
import json
import math
import os
import pickle
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=128)
    parser.add_argument("--max-words", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--margin", type=float, default=0.2)
    parser.add_argument("--output", default="runs/anet_para")
    return parser.parse_args()


class ANetParagraphs(Dataset):
    def __init__(self, root, split, vocab, max_steps, max_words):
        with open(os.path.join(root, f"{split}.json")) as f:
            ann = json.load(f)
        self.keys = sorted(ann)
        self.paras = [" ".join(s.strip() for s in ann[k]["sentences"]) for k in self.keys]
        self.vocab = vocab
        self.h5_path = os.path.join(root, "features.h5")
        self.h5 = None
        self.max_steps, self.max_words = max_steps, max_words

    def __len__(self):
        return len(self.keys)

    def _resample(self, x):
        if x.shape[0] > self.max_steps:
            x = x[np.linspace(0, x.shape[0] - 1, self.max_steps).astype(int)]
        return x

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.h5_path, "r")
        g = self.h5[self.keys[i]]
        rgbflow = self._resample(g["i3d"][()])
        audio = self._resample(g["vggish"][()])
        n = min(len(rgbflow), len(audio))
        v = torch.zeros(self.max_steps, 2048 + 128)
        v[:n] = torch.from_numpy(np.concatenate([rgbflow[:n], audio[:n]], 1))
        words = self.paras[i].lower().replace(".", " .").replace(",", " ,").split()[: self.max_words]
        ids = [self.vocab.get(w, 1) for w in words]
        t = torch.zeros(self.max_words, dtype=torch.long)
        t[: len(ids)] = torch.tensor(ids)
        return v, n, t, len(ids), i


class SeqEncoder(nn.Module):
    def __init__(self, in_dim, d, layers, max_len):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_dim, d), nn.LayerNorm(d), nn.Dropout(0.1))
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), layers)

    def forward(self, x, n):
        pad = torch.arange(x.size(1), device=x.device)[None] >= n[:, None]
        h = self.enc(self.inp(x) + self.pos[:, : x.size(1)], src_key_padding_mask=pad)
        h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        return h.sum(1) / n.clamp(min=1).unsqueeze(1)


class ParaVideoModel(nn.Module):
    def __init__(self, glove, max_steps, max_words, d=384):
        super().__init__()
        self.word_emb = nn.Embedding.from_pretrained(glove, freeze=True, padding_idx=0)
        self.text_enc = SeqEncoder(glove.size(1), d, 2, max_words)
        self.video_enc = SeqEncoder(2048 + 128, d, 2, max_steps)

    def forward(self, v, vn, t, tn):
        ev = F.normalize(self.video_enc(v, vn), dim=-1)
        et = F.normalize(self.text_enc(self.word_emb(t), tn), dim=-1)
        return ev, et


def max_margin_loss(ev, et, margin):
    # hardest-negative triplet loss (VSE++) over the local batch
    sim = et @ ev.t()
    pos = sim.diag()
    eye = torch.eye(sim.size(0), dtype=torch.bool, device=sim.device)
    cost_t = (margin + sim - pos[:, None]).clamp(min=0).masked_fill(eye, 0)
    cost_v = (margin + sim - pos[None, :]).clamp(min=0).masked_fill(eye, 0)
    return cost_t.max(1)[0].mean() + cost_v.max(0)[0].mean()


@torch.no_grad()
def evaluate(net, loader, device, n_items):
    net.eval()
    V, T, I = [], [], []
    for v, vn, t, tn, idx in loader:
        ev, et = net(v.to(device), vn.to(device), t.to(device), tn.to(device))
        V.append(ev)
        T.append(et)
        I.append(idx.to(device))
    V, T, I = torch.cat(V), torch.cat(T), torch.cat(I)
    world = dist.get_world_size()
    gv, gt, gi = ([torch.empty_like(x) for _ in range(world)] for x in (V, T, I))
    dist.all_gather(gv, V)
    dist.all_gather(gt, T)
    dist.all_gather(gi, I)
    Vall = torch.zeros(n_items, V.size(1), device=device)
    Tall = torch.zeros(n_items, T.size(1), device=device)
    Vall[torch.cat(gi)] = torch.cat(gv)
    Tall[torch.cat(gi)] = torch.cat(gt)
    sim = Tall @ Vall.t()
    r = (sim > sim.diag()[:, None]).sum(1) + 1
    net.train()
    return {f"R@{k}": 100 * (r <= k).float().mean().item() for k in (1, 5, 50)} | {"MedR": r.float().median().item()}


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(17)

    with open(os.path.join(args.data, "glove_vocab.pkl"), "rb") as f:
        vocab, vectors = pickle.load(f)  # word -> id (0 pad, 1 unk), (V, 300) array
    glove = torch.from_numpy(vectors).float()

    train_set = ANetParagraphs(args.data, "train", vocab, args.max_steps, args.max_words)
    test_set = ANetParagraphs(args.data, "val_1", vocab, args.max_steps, args.max_words)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=6, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(test_set, 256, sampler=test_sampler, num_workers=6)

    model = ParaVideoModel(glove, args.max_steps, args.max_words).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for v, vn, t, tn, _ in train_loader:
            v, vn, t, tn = v.to(device, non_blocking=True), vn.to(device), t.to(device), tn.to(device)
            ev, et = model(v, vn, t, tn)
            loss = max_margin_loss(ev, et, args.margin)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
        res = evaluate(model.module, test_loader, device, len(test_set))
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} ({time.time() - t0:.0f}s) | p2v {res}", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.output, "last.pt"))
            if res["R@1"] > best:
                best = res["R@1"]
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
