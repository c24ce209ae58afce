#!/usr/bin/env python
"""HuBERT second iteration, end to end on one allocation:

  1. every rank dumps layer-6 features of the iteration-1 model for its share of a
     fixed random subset of train utterances (written to the shared work dir)
  2. rank 0 fits one k-means model on all dumped features
  3. every rank labels its share of train/valid with that k-means model
  4. masked prediction training on the new targets

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        08_hubert_iter2_pipeline.py --data /fsx/ls960 --work-dir /fsx/exp/hubert_it2 \
        --it1-ckpt /fsx/exp/hubert_it1/ckpt_last.pt
"""
import argparse
import datetime
import glob
import os
import random
import time

import joblib
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.cluster import MiniBatchKMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SPEC = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def frames(n):
    for _, k, s in SPEC:
        n = (n - k) // s + 1
    return n


class HuBERT(nn.Module):
    def __init__(self, n_classes, d=768, depth=12, grad_ckpt=False):
        super().__init__()
        conv, c = [], 1
        for i, (o, k, s) in enumerate(SPEC):
            conv += [nn.Conv1d(c, o, k, s, bias=False)] + ([nn.GroupNorm(o, o)] if i == 0 else []) + [nn.GELU()]
            c = o
        self.cnn = nn.Sequential(*conv)
        self.cnn_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.ln = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(
            [nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True) for _ in range(depth)])
        self.final_proj = nn.Linear(d, 256)
        self.label_embs = nn.Parameter(torch.empty(n_classes, 256).uniform_())
        self.grad_ckpt = grad_ckpt

    def encode(self, wav, mask=None, stop_layer=None):
        f = self.cnn_ln(self.cnn(wav[:, None]).transpose(1, 2))
        x = self.proj(f)
        if mask is not None:
            x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = self.ln(x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        for i, blk in enumerate(self.blocks):
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
            if stop_layer is not None and i + 1 == stop_layer:
                break
        return x, f.float().pow(2).mean()

    def forward(self, wav, mask):
        x, pen = self.encode(wav, mask)
        p = self.final_proj(x).float()
        logits = F.cosine_similarity(p[:, :, None], self.label_embs.float()[None, None], dim=-1) / 0.1
        return logits, pen


def read_tsv(path):
    with open(path) as f:
        root = f.readline().strip()
        return [(os.path.join(root, a), int(b)) for a, b in (l.split("\t") for l in f.read().splitlines())]


@torch.no_grad()
def layer_feats(model, path, layer, dev):
    wav, _ = sf.read(path, dtype="float32")
    x = torch.from_numpy(wav)[None].to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h, _ = model.encode(x, stop_layer=layer)
    return h[0].float().cpu().numpy()


def make_targets(args, rank, world, dev):
    km_path = os.path.join(args.work_dir, "km.bin")
    lab_dir = os.path.join(args.work_dir, "labels")
    feat_dir = os.path.join(args.work_dir, "fit_feats")
    if rank == 0:
        os.makedirs(lab_dir, exist_ok=True)
        os.makedirs(feat_dir, exist_ok=True)
    dist.barrier()

    train = read_tsv(os.path.join(args.data, "train.tsv"))
    valid = read_tsv(os.path.join(args.data, "valid.tsv"))

    if not os.path.exists(km_path):
        ck = torch.load(args.it1_ckpt, map_location="cpu")
        it1 = HuBERT(ck["num_classes"]).to(dev).eval()
        it1.load_state_dict(ck["model"])
        # same subset on every rank (fixed seed), each rank dumps its slice
        subset = random.Random(args.seed).sample(range(len(train)), int(args.km_fit_frac * len(train)))
        mine = [layer_feats(it1, train[i][0], args.layer, dev) for i in subset[rank::world]]
        np.save(os.path.join(feat_dir, f"{rank}.npy"), np.concatenate(mine))
        dist.barrier()
        if rank == 0:
            X = np.concatenate([np.load(p) for p in sorted(glob.glob(os.path.join(feat_dir, "*.npy")))])
            km = MiniBatchKMeans(args.n_clusters, init="k-means++", batch_size=10000, n_init=20,
                                 max_no_improvement=100, reassignment_ratio=0.0, random_state=args.seed).fit(X)
            joblib.dump(km, km_path + ".tmp")
            os.replace(km_path + ".tmp", km_path)
        dist.barrier()
        km = joblib.load(km_path)
        for split, items in (("train", train), ("valid", valid)):
            with open(os.path.join(lab_dir, f"{split}.{rank}.km"), "w") as f:
                for i in range(rank, len(items), world):
                    f.write(f"{i}\t{' '.join(map(str, km.predict(layer_feats(it1, items[i][0], args.layer, dev))))}\n")
        del it1
        torch.cuda.empty_cache()
    dist.barrier()

    out = {}
    for split, items in (("train", train), ("valid", valid)):
        lab = [None] * len(items)
        for p in glob.glob(os.path.join(lab_dir, f"{split}.*.km")):
            with open(p) as f:
                for line in f:
                    i, s = line.rstrip("\n").split("\t")
                    lab[int(i)] = np.array(s.split(), dtype=np.int64)
        assert all(l is not None for l in lab), f"missing labels for {split}"
        out[split] = (items, lab)
    return out


class Labeled(Dataset):
    def __init__(self, items, labels, crop):
        self.items, self.labels, self.crop = items, labels, crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav, _ = sf.read(self.items[i][0], dtype="float32")
        lab = self.labels[i]
        if len(wav) > self.crop:
            s = random.randrange(0, (len(wav) - self.crop) // 320 + 1)
            wav, lab = wav[s * 320:s * 320 + self.crop], lab[s:s + self.crop // 320]
        return torch.from_numpy(wav), torch.from_numpy(lab)


def collate(b):
    n = min(len(w) for w, _ in b)
    t = min(min(len(l) for _, l in b), frames(n))
    return torch.stack([w[:n] for w, _ in b]), torch.stack([l[:t] for _, l in b])


def mask_spans(B, T, p=0.8, L=10):
    m = torch.zeros(B, T, dtype=torch.bool)
    k = int(p * T / L + random.random())
    for b in range(B):
        for s in random.sample(range(T - L), k):
            m[b, s:s + L] = True
    return m


def step_loss(model, wav, lab, dev):
    mask = mask_spans(wav.size(0), frames(wav.size(1))).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, pen = model(wav, mask)
    T = lab.size(1)
    m = mask[:, :T]
    return logits[:, :T][m], lab[m], pen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work-dir", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--it1-ckpt", required=True)
    ap.add_argument("--layer", type=int, default=6)
    ap.add_argument("--n-clusters", type=int, default=500)
    ap.add_argument("--km-fit-frac", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--crop", type=int, default=250000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=400000)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # k-means fitting on rank 0 keeps the others in a barrier for a while
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    data = make_targets(args, rank, world, dev)
    train_ds, valid_ds = Labeled(*data["train"], args.crop), Labeled(*data["valid"], args.crop)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)), args.batch_size,
                         collate_fn=collate, num_workers=2)

    torch.manual_seed(args.seed)
    model = DDP(HuBERT(args.n_clusters, grad_ckpt=args.grad_ckpt).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, args.warmup),
        torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, args.max_update - args.warmup)], [args.warmup])

    ckpt = os.path.join(args.work_dir, "checkpoint_last.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]

    while step < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for wav, lab in loader:
            logits, tgt, pen = step_loss(model, wav.to(dev, non_blocking=True), lab.to(dev, non_blocking=True), dev)
            loss = F.cross_entropy(logits, tgt) + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if step % 500 == 0:
                r = torch.stack([loss.detach(), (logits.argmax(-1) == tgt).float().mean()])
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {r[0]:.4f} acc_m {r[1]:.4f} "
                          f"{(time.time() - tic) / 500:.3f}s/it", flush=True)
                    tic = time.time()
            if step >= args.max_update:
                break
        epoch += 1

        model.eval()
        s = torch.zeros(3, device=dev)
        with torch.no_grad():
            for wav, lab in vloader:
                logits, tgt, _ = step_loss(model.module, wav.to(dev), lab.to(dev), dev)
                s += torch.stack([F.cross_entropy(logits, tgt, reduction="sum"),
                                  (logits.argmax(-1) == tgt).sum().float(), torch.tensor(tgt.numel(), device=dev).float()])
        dist.all_reduce(s)
        if rank == 0:
            print(f"epoch {epoch} valid loss {s[0] / s[2]:.4f} acc_m {s[1] / s[2]:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "epoch": epoch, "num_classes": args.n_clusters}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
