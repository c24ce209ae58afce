#!/usr/bin/env python
"""HuBERT iteration-2 pretraining with k-means targets refreshed from the
previous iteration's transformer features.

Stage 1 (every run): dump layer-N features of the previous iteration model,
cluster them and write frame labels for the training manifest.
Stage 2: masked prediction pretraining on the new labels.
"""
import argparse
import copy
import logging
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.cluster import MiniBatchKMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("hubert_iter")
FRAME_SHIFT = 320  # 20 ms at 16 kHz
CONV_SPEC = ((512, 10, 5),) + ((512, 3, 2),) * 4 + ((512, 2, 2),) * 2


def n_frames(n_samples):
    for _, k, s in CONV_SPEC:
        n_samples = (n_samples - k) // s + 1
    return n_samples


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--prev-ckpt", required=True, help="iteration-1 checkpoint")
    p.add_argument("--feat-layer", type=int, default=6)
    p.add_argument("--n-clusters", type=int, default=500)
    p.add_argument("--km-sample-pct", type=float, default=0.1)
    p.add_argument("--max-sample-size", type=int, default=250000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-updates", type=int, default=32000)
    p.add_argument("--max-updates", type=int, default=400000)
    p.add_argument("--mask-prob", type=float, default=0.8)
    p.add_argument("--mask-length", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--log-interval", type=int, default=200)
    p.add_argument("--save-interval", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def read_manifest(path):
    with open(path) as f:
        root = f.readline().strip()
        items = []
        for line in f:
            rel, n = line.rstrip("\n").split("\t")
            items.append((os.path.join(root, rel), int(n)))
    return items


class FeatureEncoder(nn.Module):
    def __init__(self, spec=CONV_SPEC):
        super().__init__()
        blocks, in_d = [], 1
        for i, (dim, k, s) in enumerate(spec):
            mods = [nn.Conv1d(in_d, dim, k, stride=s, bias=False)]
            if i == 0:
                mods.append(nn.GroupNorm(dim, dim))
            mods.append(nn.GELU())
            blocks.append(nn.Sequential(*mods))
            in_d = dim
        self.blocks = nn.ModuleList(blocks)

    def forward(self, wav):
        x = wav.unsqueeze(1)
        for b in self.blocks:
            x = b(x)
        return x.transpose(1, 2)


class Hubert(nn.Module):
    def __init__(self, num_classes, dim=768, layers=12, heads=12, ffn=3072, final_dim=256):
        super().__init__()
        self.encoder_cnn = FeatureEncoder()
        self.ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, dim)
        self.mask_emb = nn.Parameter(torch.empty(dim).uniform_())
        self.pos_conv = nn.Conv1d(dim, dim, 128, padding=64, groups=16)
        self.pos_ln = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(layers)])
        self.final_proj = nn.Linear(dim, final_dim)
        self.label_embs = nn.Parameter(torch.empty(num_classes, final_dim).uniform_())

    def _front(self, wav, mask=None):
        feats = self.ln(self.encoder_cnn(wav))
        pen = feats.float().pow(2).mean()
        x = self.proj(feats)
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        pos = self.pos_conv(x.transpose(1, 2))[:, :, :-1]
        return self.pos_ln(x + F.gelu(pos).transpose(1, 2)), pen

    def extract_features(self, wav, layer):
        x, _ = self._front(wav)
        for i, blk in enumerate(self.layers):
            x = blk(x)
            if i + 1 == layer:
                break
        return x

    def forward(self, wav, mask):
        x, pen = self._front(wav, mask)
        for blk in self.layers:
            x = blk(x)
        proj = self.final_proj(x)
        logits = F.cosine_similarity(proj.unsqueeze(2).float(), self.label_embs.float()[None, None], dim=-1) / 0.1
        return logits, pen


def compute_mask(bsz, T, prob, length, device):
    mask = torch.zeros(bsz, T, dtype=torch.bool)
    n_spans = max(1, int(prob * T / length + random.random()))
    for b in range(bsz):
        starts = np.random.choice(max(1, T - length), n_spans, replace=False if T - length > n_spans else True)
        for s in starts:
            mask[b, s:s + length] = True
    return mask.to(device)


@torch.no_grad()
def dump_features(model, items, layer, device):
    model.eval()
    out = []
    for path, _ in items:
        wav, sr = sf.read(path, dtype="float32")
        assert sr == 16000, path
        x = torch.from_numpy(wav).to(device).unsqueeze(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            f = model.extract_features(x, layer)
        out.append(f[0].float().cpu().numpy())
    return out


def refresh_targets(prev_model, splits, args, rank, world_size, device):
    os.makedirs(args.work_dir, exist_ok=True)
    train_items = splits["train"]
    my_idx = list(range(rank, len(train_items), world_size))
    my_items = [train_items[i] for i in my_idx]

    n_fit = max(1, int(len(my_items) * args.km_sample_pct))
    fit_items = random.sample(my_items, n_fit)
    fit_feats = np.concatenate(dump_features(prev_model, fit_items, args.feat_layer, device), axis=0)
    km = MiniBatchKMeans(n_clusters=args.n_clusters, init="k-means++", max_iter=100, batch_size=10000,
                         n_init=20, max_no_improvement=100, reassignment_ratio=0.0, compute_labels=False)
    km.fit(fit_feats)
    logger.info("rank %d: k-means inertia %.1f on %d frames", rank, -km.score(fit_feats), len(fit_feats))

    for split, items in splits.items():
        idx = list(range(rank, len(items), world_size))
        feats = dump_features(prev_model, [items[i] for i in idx], args.feat_layer, device)
        with open(os.path.join(args.work_dir, f"{split}.km.{rank}"), "w") as f:
            for i, feat in zip(idx, feats):
                f.write(f"{i}\t" + " ".join(map(str, km.predict(feat).tolist())) + "\n")
    dist.barrier()

    labels = {}
    for split, items in splits.items():
        lab = {}
        for r in range(world_size):
            with open(os.path.join(args.work_dir, f"{split}.km.{r}")) as f:
                for line in f:
                    i, labs = line.rstrip("\n").split("\t")
                    lab[int(i)] = np.asarray(labs.split(), dtype=np.int64)
        labels[split] = [lab[i] for i in range(len(items))]
    return labels


class LabeledAudio(Dataset):
    def __init__(self, items, labels, max_size):
        self.items, self.labels, self.max_size = items, labels, max_size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, n = self.items[i]
        wav, _ = sf.read(path, dtype="float32")
        lab = self.labels[i]
        if len(wav) > self.max_size:
            start = random.randint(0, (len(wav) - self.max_size) // FRAME_SHIFT) * FRAME_SHIFT
            wav = wav[start:start + self.max_size]
            lab = lab[start // FRAME_SHIFT:(start + self.max_size) // FRAME_SHIFT]
        return torch.from_numpy(wav), torch.from_numpy(lab)


def collate(batch):
    n = min(w.numel() for w, _ in batch)
    n -= n % FRAME_SHIFT
    wavs = torch.stack([w[:n] for w, _ in batch])
    n_lab = min(n // FRAME_SHIFT, min(l.numel() for _, l in batch))
    labs = torch.stack([l[:n_lab] for _, l in batch])
    return wavs, labs


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    splits = {"train": read_manifest(os.path.join(args.manifest_dir, "train.tsv")),
              "valid": read_manifest(os.path.join(args.manifest_dir, "valid.tsv"))}

    prev_state = torch.load(args.prev_ckpt, map_location="cpu")
    prev = Hubert(prev_state["num_classes"]).to(device)
    prev.load_state_dict(prev_state["model"])
    labels = refresh_targets(prev, splits, args, rank, world_size, device)
    del prev, prev_state
    torch.cuda.empty_cache()

    model = Hubert(args.n_clusters).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min((s + 1) / args.warmup_updates,
                             max(0.0, (args.max_updates - s) / (args.max_updates - args.warmup_updates))))

    ds = LabeledAudio(splits["train"], labels["train"], args.max_sample_size)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)
    vds = LabeledAudio(splits["valid"], labels["valid"], args.max_sample_size)
    vloader = DataLoader(torch.utils.data.Subset(vds, range(rank, len(vds), world_size)),
                         batch_size=args.batch_size, collate_fn=collate, num_workers=2)

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_updates:
        sampler.set_epoch(epoch)
        model.train()
        for wav, lab in loader:
            wav = wav.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                mask = compute_mask(wav.size(0), n_frames(wav.size(1)), args.mask_prob, args.mask_length, device)
                logits, pen = model(wav, mask)
            T = min(logits.size(1), lab.size(1))
            m = mask[:, :T]
            loss = F.cross_entropy(logits[:, :T][m], lab[:, :T][m]) + 10.0 * pen
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optim.step()
            sched.step()
            step += 1

            if step % args.log_interval == 0:
                stats = torch.stack([loss.detach().float(),
                                     (logits[:, :T][m].argmax(-1) == lab[:, :T][m]).float().mean()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    logger.info("epoch %d step %d loss %.4f acc %.4f lr %.2e %.1fs", epoch, step,
                                stats[0].item(), stats[1].item(), sched.get_last_lr()[0], time.time() - t0)
                    t0 = time.time()
            if step % args.save_interval == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                            "step": step, "num_classes": args.n_clusters},
                           os.path.join(args.work_dir, f"checkpoint_{step}.pt"))
            if step >= args.max_updates:
                break
        epoch += 1

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for wav, lab in vloader:
                wav, lab = wav.to(device), lab.to(device)
                mask = compute_mask(wav.size(0), n_frames(wav.size(1)), args.mask_prob, args.mask_length, device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _ = model.module(wav, mask)
                T = min(logits.size(1), lab.size(1))
                m = mask[:, :T]
                tot[0] += (logits[:, :T][m].argmax(-1) == lab[:, :T][m]).sum()
                tot[1] += m.sum()
        dist.all_reduce(tot)
        if rank == 0:
            logger.info("epoch %d valid masked acc %.4f", epoch, (tot[0] / tot[1]).item())

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step, "num_classes": args.n_clusters},
                   os.path.join(args.work_dir, "checkpoint_last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
