"""Compound Word Transformer (Hsiao et al., 2021) on the AILabs.tw Pop1K7 piano set, with an auxiliary
song-key classifier for the pieces that have a key annotation.

Data (from the CP-Transformer repo): train_data_linear.npz with x, y, mask of shape (N, 3584[, 7]) and
dictionary.pkl; song keys in keys.json (index of the song -> 0..23, major then minor).

torchrun --nproc_per_node=4 10_cp_word_transformer.py --data data/pop1k7_cp --exp runs/cp_key
"""
import argparse
import json
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

FIELDS = ["tempo", "chord", "bar-beat", "type", "pitch", "duration", "velocity"]
EMB_SIZES = [128, 256, 64, 32, 512, 128, 128]


class CPSongs(Dataset):
    """Songs are padded to 3584 steps; each is cut into windows of seq_len steps (empty windows dropped)."""

    def __init__(self, npz, song_ids, keys, seq_len, pitch_shift=None, max_shift=0):
        self.x, self.y, self.mask = npz["x"], npz["y"], npz["mask"]
        self.keys, self.seq_len = keys, seq_len
        self.pitch_shift, self.max_shift = pitch_shift, max_shift
        self.items = []
        for s in song_ids:
            n = int(self.mask[s].sum())
            self.items += [(s, st) for st in range(0, n, seq_len)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, st = self.items[i]
        sl = slice(st, st + self.seq_len)
        x, y, m = self.x[s, sl].copy(), self.y[s, sl].copy(), self.mask[s, sl].copy()
        key = self.keys.get(str(s), -1)
        if self.max_shift:
            k = np.random.randint(-self.max_shift, self.max_shift + 1)
            ok = self.pitch_shift(x, k) and self.pitch_shift(y, k)
            if ok and key >= 0:
                key = (key % 12 + k) % 12 + 12 * (key // 12)
        return torch.from_numpy(x).long(), torch.from_numpy(y).long(), torch.from_numpy(m).float(), torch.tensor(key)


class PitchShift:
    def __init__(self, event2word):
        voc = event2word["pitch"]
        self.to_pitch = {i: int(e.split("_")[1]) for e, i in voc.items() if e.startswith("Note_Pitch_")}
        self.to_word = {p: i for i, p in self.to_pitch.items()}
        self.col = FIELDS.index("pitch")

    def __call__(self, arr, k):
        """Shift pitch words in-place; returns False (and leaves arr alone) if a note would leave the range."""
        rows = [r for r in range(len(arr)) if arr[r, self.col] in self.to_pitch]
        new = [self.to_pitch[arr[r, self.col]] + k for r in rows]
        if any(p not in self.to_word for p in new):
            return False
        for r, p in zip(rows, new):
            arr[r, self.col] = self.to_word[p]
        return True


class CPTransformer(nn.Module):
    def __init__(self, n_tokens, d_model=512, n_layers=12, n_heads=8, max_len=512, n_keys=24, dropout=0.1):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(n, e) for n, e in zip(n_tokens, EMB_SIZES))
        self.in_linear = nn.Linear(sum(EMB_SIZES), d_model)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 2048, dropout, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)
        # type is predicted first; the other fields are predicted from hidden state + chosen type
        self.proj_type = nn.Linear(d_model, n_tokens[3])
        self.type_emb_out = nn.Embedding(n_tokens[3], 32)
        self.proj_concat = nn.Linear(d_model + 32, d_model)
        self.heads = nn.ModuleList(nn.Linear(d_model, n) for n in n_tokens)
        self.key_head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Linear(d_model, n_keys))

    def forward(self, x, y_type):
        l = x.size(1)
        h = self.in_linear(torch.cat([e(x[..., i]) for i, e in enumerate(self.embs)], -1)) + self.pos[:, :l]
        causal = torch.triu(torch.ones(l, l, dtype=torch.bool, device=x.device), 1)
        h = self.norm(self.transformer(h, mask=causal))
        logit_type = self.proj_type(h)
        hc = self.proj_concat(torch.cat([h, self.type_emb_out(y_type)], -1))  # teacher-forced type
        logits = [head(hc) for head in self.heads]
        logits[3] = logit_type
        return logits, h

    def key_logits(self, h, mask):
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.key_head(pooled)


def cp_loss(logits, y, mask):
    losses = []
    for i, lg in enumerate(logits):
        l = F.cross_entropy(lg.float().transpose(1, 2), y[..., i], reduction="none")
        losses.append((l * mask).sum() / mask.sum())
    return losses


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(2 + len(FIELDS), device=device, dtype=torch.float64)
    for x, y, m, _ in loader:
        x, y, m = x.to(device), y.to(device), m.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = net(x, y[..., 3])
        for i, lg in enumerate(logits):
            acc[0] += (F.cross_entropy(lg.float().transpose(1, 2), y[..., i], reduction="none") * m).sum()
            acc[2 + i] += ((lg.argmax(-1) == y[..., i]).float() * m).sum()
        acc[1] += m.sum()
    dist.all_reduce(acc)
    net.train()
    return math.exp(acc[0] / acc[1]), {f: (acc[2 + i] / acc[1]).item() for i, f in enumerate(FIELDS)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/pop1k7_cp")
    ap.add_argument("--exp", default="runs/cp_key")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--key_weight", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    npz = dict(np.load(os.path.join(args.data, "train_data_linear.npz")))
    with open(os.path.join(args.data, "dictionary.pkl"), "rb") as f:
        event2word, word2event = pickle.load(f)
    with open(os.path.join(args.data, "keys.json")) as f:
        keys = json.load(f)                         # only ~40% of the songs are annotated
    n_tokens = [len(event2word[k]) for k in ["tempo", "chord", "bar-beat", "type", "pitch", "duration", "velocity"]]
    n_songs = len(npz["x"])
    val_songs = list(range(0, n_songs, 20))
    train_songs = [s for s in range(n_songs) if s % 20 != 0]

    train_set = CPSongs(npz, train_songs, keys, args.seq_len, PitchShift(event2word), max_shift=5)
    val_set = CPSongs(npz, val_songs, keys, args.seq_len)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), args.batch_size, num_workers=2)

    model = CPTransformer(n_tokens, max_len=args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader), eta_min=args.lr * 0.1)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        with open(os.path.join(args.exp, "args.json"), "w") as f:
            json.dump(vars(args), f)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, log = time.time(), []
        for x, y, m, key in loader:
            x, y, m, key = x.to(device), y.to(device), m.to(device), key.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, h = model(x, y[..., 3])
                losses = cp_loss(logits, y, m)
                loss = sum(losses) / len(losses)
                has_key = key >= 0
                if has_key.any():
                    kl = model.module.key_logits(h[has_key], m[has_key])
                    loss = loss + args.key_weight * F.cross_entropy(kl.float(), key[has_key])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            log.append([l.item() for l in losses])

        ppl, field_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            mean = np.mean(log, 0)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " + " ".join(f"{f}:{v:.3f}" for f, v in zip(FIELDS, mean))
                  + f" | val ppl {ppl:.3f} pitch acc {field_acc['pitch']:.3f} dur acc {field_acc['duration']:.3f}",
                  flush=True)
            if epoch % args.save_every == 0 or epoch == args.epochs - 1:
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                            "n_tokens": n_tokens}, os.path.join(args.exp, f"loss_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
