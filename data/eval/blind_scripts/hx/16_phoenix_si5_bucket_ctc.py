"""PHOENIX-2014 signer-independent (SI5: Signer05 held out) gloss recognition.

Input: per-video frame features from a frozen encoder (T, 512) in one .npy each.
Length-bucketed batches, Conformer-lite encoder, CTC, early stopping on dev WER.

    torchrun --nproc_per_node=4 16_phoenix_si5_bucket_ctc.py --cfg configs/si5.yaml
"""
import argparse
import math
import os
import random

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def load_corpus(corpus_csv):
    rows = []
    with open(corpus_csv, encoding="utf-8") as f:
        next(f)
        for line in f:
            vid, _, signer, ann = line.rstrip("\n").split("|")
            rows.append((vid, signer, ann.split()))
    return rows


class FeatureSet(Dataset):
    def __init__(self, rows, feat_dir, stoi, train):
        self.rows, self.feat_dir, self.stoi, self.train = rows, feat_dir, stoi, train
        self.lengths = [np.load(os.path.join(feat_dir, r[0] + ".npy"), mmap_mode="r").shape[0] for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        vid, _, glosses = self.rows[i]
        x = np.load(os.path.join(self.feat_dir, vid + ".npy")).astype(np.float32)
        if self.train:
            t = len(x)
            idx = np.sort(np.random.choice(t, int(t * np.random.uniform(0.8, 1.0)), replace=False))
            x = x[idx]
        y = [self.stoi[g] for g in glosses if g in self.stoi]
        return torch.from_numpy(x), torch.tensor(y, dtype=torch.long), i


def collate(batch):
    xs, ys, idx = zip(*batch)
    lens = torch.tensor([len(x) for x in xs])
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), lens, torch.cat(ys),
            torch.tensor([len(y) for y in ys]), list(idx))


class DistributedBucketBatchSampler(Sampler):
    """Groups videos of similar length; every rank gets the same number of batches."""

    def __init__(self, lengths, batch_size, rank, world_size, seed=0, bucket_mult=50):
        self.lengths, self.batch_size = lengths, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.bucket = batch_size * bucket_mult
        self.epoch = 0
        n_batches = math.ceil(len(lengths) / batch_size)
        self.per_rank = n_batches // world_size

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)  # identical on every rank
        order = list(range(len(self.lengths)))
        g.shuffle(order)
        batches = []
        for s in range(0, len(order), self.bucket):
            chunk = sorted(order[s:s + self.bucket], key=lambda i: self.lengths[i])
            batches += [chunk[k:k + self.batch_size] for k in range(0, len(chunk), self.batch_size)]
        g.shuffle(batches)
        batches = batches[: self.per_rank * self.world_size]
        return iter(batches[self.rank::self.world_size])

    def __len__(self):
        return self.per_rank


class ConvModule(nn.Module):
    def __init__(self, d, k=15):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, k, padding=k // 2, groups=d)
        self.norm = nn.GroupNorm(1, d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        y = nn.functional.glu(self.pw1(self.ln(x).transpose(1, 2)), dim=1)
        y = self.pw2(nn.functional.silu(self.norm(self.dw(y))))
        return x + y.transpose(1, 2)


class ConformerLite(nn.Module):
    def __init__(self, in_dim, vocab, d=384, layers=4, heads=6):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_dim, d), nn.Dropout(0.1))
        self.sub = nn.Conv1d(d, d, 5, stride=2, padding=2)
        self.attn = nn.ModuleList([nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
                                   for _ in range(layers)])
        self.conv = nn.ModuleList([ConvModule(d) for _ in range(layers)])
        self.out = nn.Linear(d, vocab)

    def forward(self, x, lens):
        x = self.sub(self.inp(x).transpose(1, 2)).transpose(1, 2)
        lens = torch.div(lens - 1, 2, rounding_mode="floor") + 1
        pad = torch.arange(x.shape[1], device=x.device)[None] >= lens[:, None]
        for a, c in zip(self.attn, self.conv):
            x = c(a(x, src_key_padding_mask=pad)).masked_fill(pad[..., None], 0.0)
        return self.out(x), lens


@torch.no_grad()
def dev_wer(model, loader, dataset, device):
    model.eval()
    local = []
    for x, lens, _, _, idx in loader:
        logits, out_lens = model(x.to(device), lens.to(device))
        for i, seq, n in zip(idx, logits.argmax(-1).tolist(), out_lens.tolist()):
            hyp = [s for k, s in enumerate(seq[:n]) if s != 0 and (k == 0 or s != seq[k - 1])]
            local.append((i, hyp))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)  # hypotheses have different lengths on each rank
    result = [None]
    if dist.get_rank() == 0:
        hyps = dict(p for part in gathered for p in part)
        assert len(hyps) == len(dataset)
        errs = words = 0
        for i, hyp in hyps.items():
            ref = [dataset.stoi[g] for g in dataset.rows[i][2] if g in dataset.stoi]
            errs += editdistance.eval(hyp, ref)
            words += len(ref)
        result[0] = 100.0 * errs / words
    dist.broadcast_object_list(result, src=0)
    return result[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg["seed"] + rank)  # feature-dropout augmentation only
    torch.manual_seed(cfg["seed"])

    rows = load_corpus(cfg["train_corpus"]) + load_corpus(cfg["dev_corpus"])
    held_out = set(cfg["test_signers"])  # e.g. ["Signer05"]
    train_rows = [r for r in rows if r[1] not in held_out]
    dev_rows = load_corpus(cfg["si5_dev_corpus"])
    vocab = sorted({g for r in train_rows for g in r[2]})
    stoi = {g: i + 1 for i, g in enumerate(vocab)}

    train_set = FeatureSet(train_rows, cfg["feat_dir"], stoi, train=True)
    dev_set = FeatureSet(dev_rows, cfg["feat_dir"], stoi, train=False)
    batch_sampler = DistributedBucketBatchSampler(train_set.lengths, cfg["batch_size"], rank, world, cfg["seed"])
    train_dl = DataLoader(train_set, batch_sampler=batch_sampler, collate_fn=collate, num_workers=6, pin_memory=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)), 16,
                        collate_fn=collate, num_workers=4)

    model = DDP(ConformerLite(cfg["in_dim"], len(stoi) + 1).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg["lr"], total_steps=cfg["epochs"] * len(train_dl),
                                                pct_start=0.05)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    best, patience = float("inf"), 0
    os.makedirs(cfg["out"], exist_ok=True)
    for epoch in range(cfg["epochs"]):
        model.train()
        batch_sampler.set_epoch(epoch)
        skipped = 0
        for x, lens, ys, ylens, _ in train_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, out_lens = model(x.to(device, non_blocking=True), lens.to(device))
            loss = ctc(logits.float().log_softmax(-1).transpose(0, 1), ys.to(device), out_lens, ylens.to(device))
            # skip the step on all ranks together if any rank produced a NaN
            bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=device)
            dist.all_reduce(bad)
            if bad.item() > 0:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()

        wer = dev_wer(model, dev_dl, dev_set, device)
        if rank == 0:
            print(f"epoch {epoch} dev WER {wer:.2f} (skipped {skipped} steps)", flush=True)
        if wer < best:
            best, patience = wer, 0
            if rank == 0:
                tmp = os.path.join(cfg["out"], "best.pt.tmp")
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch, "wer": wer}, tmp)
                os.replace(tmp, os.path.join(cfg["out"], "best.pt"))
        else:
            patience += 1
        if patience >= cfg.get("patience", 8):  # same decision on every rank (wer was broadcast)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
