"""Deep (36-layer) transformer CTC encoder with LayerDrop and activation checkpointing,
trained on long-form speech with dynamic duration batches.

    torchrun --nproc_per_node=8 14_asr_deep_layerdrop.py --train-tsv data/train.tsv \
        --dev-tsv data/dev.tsv --units data/units.txt --save exp/deep36
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler


def read_tsv(path):
    """root dir on the first line, then: relative_path<TAB>num_samples<TAB>transcript"""
    with open(path) as f:
        root = f.readline().strip()
        rows = []
        for line in f:
            rel, n, text = line.rstrip("\n").split("\t")
            rows.append((os.path.join(root, rel), int(n), text))
    return rows


class SpeechDataset(Dataset):
    def __init__(self, rows, unit2id):
        self.rows, self.unit2id = rows, unit2id
        self.fbank = torchaudio.compliance.kaldi.fbank

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, _, text = self.rows[i]
        wav, sr = torchaudio.load(path)
        feats = self.fbank(wav * 32768, num_mel_bins=80, sample_frequency=sr)
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        labels = torch.tensor([self.unit2id[u] for u in text.split()])
        return feats, labels


def collate(items):
    feats, labels = zip(*items)
    return (nn.utils.rnn.pad_sequence(feats, batch_first=True), torch.tensor([f.size(0) for f in feats]),
            nn.utils.rnn.pad_sequence(labels, batch_first=True), torch.tensor([l.size(0) for l in labels]))


class DistributedDynamicSampler(Sampler):
    def __init__(self, num_samples, max_samples_per_batch, num_replicas, rank, shuffle=True, seed=0, even=True):
        self.sizes = num_samples
        self.max_batch = max_samples_per_batch
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.even = shuffle, seed, even
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self):
        rnd = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.sizes)))
        if self.shuffle:
            rnd.shuffle(idx)
        # sorted inside windows of 50k utterances
        out = []
        for s in range(0, len(idx), 50000):
            win = sorted(idx[s:s + 50000], key=lambda i: self.sizes[i])
            cur, longest = [], 0
            for i in win:
                l = max(longest, self.sizes[i])
                if cur and l * (len(cur) + 1) > self.max_batch:
                    out.append(cur)
                    cur, l = [], self.sizes[i]
                cur.append(i)
                longest = l
            if cur:
                out.append(cur)
        if self.shuffle:
            rnd.shuffle(out)
        if self.even:
            out = out[: len(out) // self.num_replicas * self.num_replicas]
        return out[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.batches())


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, pad_mask):
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0])
        return x + self.drop(self.ff(self.ln2(x)))


class DeepCTC(nn.Module):
    def __init__(self, n_units, d=768, heads=12, layers=36, dropout=0.1, layerdrop=0.1, grad_ckpt=True):
        super().__init__()
        self.front = nn.Sequential(nn.Conv1d(80, d, 3, stride=2, padding=1), nn.GELU(),
                                   nn.Conv1d(d, d, 3, stride=2, padding=1), nn.GELU())
        self.pos_conv = nn.Conv1d(d, d, 129, padding=64, groups=16)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, n_units + 1)
        self.layerdrop, self.grad_ckpt = layerdrop, grad_ckpt

    def forward(self, x, lens):
        x = self.front(x.transpose(1, 2))
        x = (x + F.gelu(self.pos_conv(x))).transpose(1, 2)
        lens = (lens + 3) // 4
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        for layer in self.layers:
            if self.training and random.random() < self.layerdrop:
                continue
            if self.training and self.grad_ckpt:
                x = checkpoint(layer, x, pad, use_reentrant=True)
            else:
                x = layer(x, pad)
        return self.out(self.ln(x)), lens


@torch.no_grad()
def dev_uer(model, loader, device):
    model.eval()
    errs = torch.zeros(2, device=device)
    for x, xl, y, yl in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, ol = model(x.to(device), xl.to(device))
        for p, n, ref, rn in zip(logits.argmax(-1).cpu(), ol.cpu(), y, yl):
            hyp = [t for t in torch.unique_consecutive(p[:n]).tolist() if t != 0]
            errs[0] += torchaudio.functional.edit_distance(hyp, ref[:rn].tolist())
            errs[1] += rn.item()
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-tsv", required=True)
    ap.add_argument("--dev-tsv", required=True)
    ap.add_argument("--units", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--max-samples", type=int, default=3_200_000, help="audio samples per GPU batch (padded)")
    ap.add_argument("--max-updates", type=int, default=400000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--layerdrop", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    with open(args.units) as f:
        units = [l.split()[0] for l in f if l.strip()]
    unit2id = {u: i + 1 for i, u in enumerate(units)}

    train_rows, dev_rows = read_tsv(args.train_tsv), read_tsv(args.dev_tsv)
    train_sampler = DistributedDynamicSampler([r[1] for r in train_rows], args.max_samples, world, rank, seed=args.seed)
    dev_sampler = DistributedDynamicSampler([r[1] for r in dev_rows], args.max_samples, world, rank,
                                            shuffle=False, even=False)
    train_loader = DataLoader(SpeechDataset(train_rows, unit2id), batch_sampler=train_sampler, collate_fn=collate,
                              num_workers=10, pin_memory=True, persistent_workers=True, prefetch_factor=4)
    dev_loader = DataLoader(SpeechDataset(dev_rows, unit2id), batch_sampler=dev_sampler, collate_fn=collate,
                            num_workers=4)

    model = DeepCTC(len(units), layerdrop=args.layerdrop).to(device)
    # LayerDrop skips whole layers, so some parameters get no gradient in a given step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    tri_stage = lambda u: min((u + 1) / args.warmup, 0.05 ** max(0.0, (u - 0.5 * args.max_updates) / (0.5 * args.max_updates)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, tri_stage)

    updates, epoch, best = 0, 0, float("inf")
    while updates < args.max_updates:
        train_sampler.set_epoch(epoch)
        model.train()
        for x, xl, y, yl in train_loader:
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ol = model(x, xl)
            loss = F.ctc_loss(logits.float().log_softmax(-1).transpose(0, 1), y, ol, yl, blank=0,
                              reduction="mean", zero_infinity=True)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            updates += 1
            if rank == 0 and updates % 200 == 0:
                print(f"upd {updates} ep {epoch} loss {loss.item():.3f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if updates >= args.max_updates:
                break

        uer = dev_uer(model.module, dev_loader, device)
        if rank == 0:
            print(f"epoch {epoch} (upd {updates}): dev UER {100 * uer:.2f}", flush=True)
            os.makedirs(args.save, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "updates": updates, "epoch": epoch}
            torch.save(state, os.path.join(args.save, "checkpoint_last.pt"))
            if uer < best:
                best = uer
                torch.save(state, os.path.join(args.save, "checkpoint_best.pt"))
        dist.barrier()
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
