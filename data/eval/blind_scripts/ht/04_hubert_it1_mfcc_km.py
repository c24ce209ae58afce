"""HuBERT BASE, iteration 1: MFCC k-means targets + masked prediction.

Launched on 4 nodes x 8 GPUs through Slurm, one torchrun per node:

    srun --nodes=4 --ntasks-per-node=1 torchrun --nnodes=4 --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        04_hubert_it1_mfcc_km.py --manifest /datasets/ls960 --save-dir /checkpoint/$USER/hubert_it1
"""
import argparse
import datetime
import logging
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
import torchaudio
from sklearn.cluster import MiniBatchKMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LOG = logging.getLogger("hubert")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--label-dir", default=os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "hubert_mfcc_km"))
    p.add_argument("--n-clusters", type=int, default=100)
    p.add_argument("--km-fit-utts", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--max-sample-size", type=int, default=250000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=32000)
    p.add_argument("--max-update", type=int, default=250000)
    p.add_argument("--mask-prob", type=float, default=0.8)
    p.add_argument("--save-every", type=int, default=25000)
    return p.parse_args()


def read_tsv(path):
    with open(path) as f:
        root = f.readline().strip()
        return [(os.path.join(root, l.split("\t")[0]), int(l.split("\t")[1])) for l in f if l.strip()]


def mfcc_39(path):
    wav, sr = sf.read(path, dtype="float32")
    x = torch.from_numpy(wav).unsqueeze(0)
    m = torchaudio.compliance.kaldi.mfcc(x, sample_frequency=sr, use_energy=False)  # T x 13, 100 Hz
    d1 = torchaudio.functional.compute_deltas(m.T.unsqueeze(0))
    d2 = torchaudio.functional.compute_deltas(d1)
    feat = torch.cat([m.T.unsqueeze(0), d1, d2], 1)[0].T
    return feat[::2].numpy()  # 50 Hz, same rate as the CNN encoder


def build_labels(args, rank, world):
    km_path = os.path.join(args.label_dir, "km_mfcc.bin")
    train = read_tsv(os.path.join(args.manifest, "train.tsv"))
    valid = read_tsv(os.path.join(args.manifest, "valid.tsv"))
    if rank == 0 and not os.path.exists(km_path):
        os.makedirs(args.label_dir, exist_ok=True)
        rng = random.Random(0)
        fit = np.concatenate([mfcc_39(p) for p, _ in rng.sample(train, args.km_fit_utts)])
        km = MiniBatchKMeans(args.n_clusters, batch_size=10000, n_init=20, max_no_improvement=100,
                             reassignment_ratio=0.0, random_state=0).fit(fit)
        joblib.dump(km, km_path)
        LOG.info("fitted k-means on %d MFCC frames", len(fit))
    dist.barrier()

    km = joblib.load(km_path)
    for split, items in (("train", train), ("valid", valid)):
        out = os.path.join(args.label_dir, f"{split}.km.{rank}")
        if not os.path.exists(out):
            with open(out + ".part", "w") as f:
                for i in range(rank, len(items), world):
                    f.write(f"{i} " + " ".join(map(str, km.predict(mfcc_39(items[i][0])))) + "\n")
            os.replace(out + ".part", out)
    dist.barrier()

    labels = {}
    for split, items in (("train", train), ("valid", valid)):
        lab = [None] * len(items)
        for r in range(world):
            with open(os.path.join(args.label_dir, f"{split}.km.{r}")) as f:
                for line in f:
                    parts = line.split()
                    lab[int(parts[0])] = np.array(parts[1:], dtype=np.int64)
        labels[split] = (items, lab)
    return labels


class KmDataset(Dataset):
    def __init__(self, items, labels, max_size):
        self.items, self.labels, self.max_size = items, labels, max_size

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav, _ = sf.read(self.items[i][0], dtype="float32")
        lab = self.labels[i]
        n = min(len(wav) // 320, len(lab))
        wav, lab = wav[: n * 320], lab[:n]
        if n * 320 > self.max_size:
            f = self.max_size // 320
            s = random.randint(0, n - f)
            wav, lab = wav[s * 320:(s + f) * 320], lab[s:s + f]
        return torch.from_numpy(wav), torch.from_numpy(lab)


def collate(batch):
    f = min(l.numel() for _, l in batch)
    return torch.stack([w[: f * 320] for w, _ in batch]), torch.stack([l[:f] for _, l in batch])


class HubertBase(nn.Module):
    def __init__(self, n_classes, d=768):
        super().__init__()
        spec = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2
        conv, c_in = [], 1
        for i, (c, k, s) in enumerate(spec):
            conv += [nn.Conv1d(c_in, c, k, s, bias=False)] + ([nn.GroupNorm(c, c)] if i == 0 else []) + [nn.GELU()]
            c_in = c
        self.cnn = nn.Sequential(*conv)
        self.norm = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True), 12)
        self.head = nn.Linear(d, 256)
        self.label_embs = nn.Embedding(n_classes, 256)

    def forward(self, wav, mask):
        f = self.norm(self.cnn(wav.unsqueeze(1)).transpose(1, 2))
        x = self.proj(f)
        x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2)
        h = self.head(self.tf(x))
        return F.cosine_similarity(h.unsqueeze(2).float(), self.label_embs.weight.float()[None, None], -1) / 0.1, \
            f.float().pow(2).mean()


def span_mask(B, T, prob, L=10):
    m = torch.zeros(B, T, dtype=torch.bool)
    n = int(prob * T / L + random.random())
    for b in range(B):
        for s in random.sample(range(T - L), n):
            m[b, s:s + L] = True
    return m


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # label preparation runs before training starts; give the barriers room
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[{rank}] %(asctime)s %(message)s")
    dev = torch.device("cuda", local_rank)

    labels = build_labels(args, rank, world)
    train_ds = KmDataset(*labels["train"], args.max_sample_size)
    valid_ds = KmDataset(*labels["valid"], args.max_sample_size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, drop_last=True)
    valid_shard = torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world))
    vloader = DataLoader(valid_shard, args.batch_size, collate_fn=collate, num_workers=4)

    model = DDP(HubertBase(args.n_clusters).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup if s < args.warmup else max(0.0, (args.max_update - s) / (args.max_update - args.warmup)))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.save_dir, exist_ok=True)
    step, epoch = 0, 0
    while step < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for wav, lab in loader:
            wav, lab = wav.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            mask = span_mask(wav.size(0), lab.size(1), args.mask_prob).to(dev)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, pen = model(wav, mask)
            T = min(logits.size(1), lab.size(1))
            m = mask[:, :T]
            loss = F.cross_entropy(logits[:, :T][m], lab[:, :T][m]) + 10 * pen
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                LOG.info("step %d loss %.4f lr %.2e %.2fs/it", step, l.item(), sched.get_last_lr()[0],
                         (time.time() - tic) / 200)
                tic = time.time()
            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                            "num_classes": args.n_clusters}, os.path.join(args.save_dir, f"ckpt_{step}.pt"))
            if step >= args.max_update:
                break
        epoch += 1

        model.eval()
        agg = torch.zeros(2, device=dev)
        with torch.no_grad():
            for wav, lab in vloader:
                wav, lab = wav.to(dev), lab.to(dev)
                mask = span_mask(wav.size(0), lab.size(1), args.mask_prob).to(dev)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, _ = model.module(wav, mask)
                T = min(logits.size(1), lab.size(1))
                m = mask[:, :T]
                agg[0] += (logits[:, :T][m].argmax(-1) == lab[:, :T][m]).sum()
                agg[1] += m.sum()
        dist.all_reduce(agg)
        LOG.info("epoch %d valid masked acc %.4f", epoch, (agg[0] / agg[1]).item())

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step, "num_classes": args.n_clusters},
                   os.path.join(args.save_dir, "ckpt_last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
