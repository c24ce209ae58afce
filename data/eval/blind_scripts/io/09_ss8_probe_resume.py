"""Secondary-structure (Q3 / Q8) probe on a frozen ESM-2 backbone, NetSurfP-2.0 data.

The backbone runs without gradients on every rank; only the convolutional +
BiLSTM head is trained and wrapped in DDP. Jobs are preemptible, so training
resumes from --resume (the last checkpoint) when it is given.

    torchrun --nproc_per_node=4 09_ss8_probe_resume.py --train data/netsurfp/train.jsonl \
        --valid data/netsurfp/cb513.jsonl --resume runs/ss8/last.pt
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import esm

SS8 = "GHIBESTC"
SS8_TO_SS3 = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])   # G,H,I -> H ; B,E -> E ; S,T,C -> C


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--esm", default="esm2_t36_3B_UR50D")
    ap.add_argument("--layer", type=int, default=-1)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=1022)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default="runs/ss8")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class NetSurfP(Dataset):
    def __init__(self, path, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                seq, ss = r["seq"][:max_len], r["ss8"][:max_len]
                disorder = r.get("disorder", [0] * len(seq))[:max_len]
                self.items.append((r["id"], seq, ss, disorder))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Collate:
    def __init__(self, alphabet):
        self.bc = alphabet.get_batch_converter()

    def __call__(self, batch):
        ids, seqs, ss, dis = zip(*batch)
        _, _, tokens = self.bc(list(zip(ids, seqs)))
        L = max(len(s) for s in seqs)
        y = torch.full((len(seqs), L), -100, dtype=torch.long)
        for b, (s, d) in enumerate(zip(ss, dis)):
            lab = torch.tensor([SS8.index(c) for c in s])
            lab[torch.tensor(d, dtype=torch.bool)] = -100     # disordered residues are not scored
            y[b, :len(s)] = lab
        return tokens, y


class SSHead(nn.Module):
    def __init__(self, d_in, hidden=256, n_cls=8):
        super().__init__()
        self.proj = nn.Sequential(nn.Dropout(0.25), nn.Linear(d_in, hidden), nn.ReLU())
        self.conv = nn.Conv1d(hidden, hidden, 9, padding=4)
        self.lstm = nn.LSTM(hidden, hidden // 2, num_layers=2, batch_first=True, bidirectional=True, dropout=0.25)
        self.out = nn.Linear(hidden, n_cls)

    def forward(self, h):
        x = self.proj(h)
        x = x + F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        x, _ = self.lstm(x)
        return self.out(x)


@torch.no_grad()
def embed(backbone, tokens, layer, L):
    out = backbone(tokens, repr_layers=[layer])
    return out["representations"][layer][:, 1:L + 1].float()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        esm.pretrained.load_model_and_alphabet(args.esm)    # download once into the hub cache
    dist.barrier()
    backbone, alphabet = esm.pretrained.load_model_and_alphabet(args.esm)
    backbone = backbone.half().eval().to(device)
    for p in backbone.parameters():
        p.requires_grad = False
    layer = backbone.num_layers if args.layer < 0 else args.layer

    head = SSHead(backbone.embed_dim).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    start_epoch, best_q3 = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        head.load_state_dict(ckpt["head"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_q3 = ckpt["epoch"] + 1, ckpt["best_q3"]
    head = DDP(head, device_ids=[local_rank])

    collate = Collate(alphabet)
    train_set, valid_set = NetSurfP(args.train, args.max_len), NetSurfP(args.valid, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True)
    valid_shard = torch.utils.data.Subset(valid_set, range(rank, len(valid_set), world))
    valid_loader = DataLoader(valid_shard, batch_size=args.batch_size, collate_fn=collate, num_workers=2)
    ss3_map = SS8_TO_SS3.to(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        head.train()
        t0 = time.time()
        for i, (tokens, y) in enumerate(train_loader):
            tokens, y = tokens.to(device), y.to(device)
            h = embed(backbone, tokens, layer, y.shape[1])
            logits = head(h)
            loss = F.cross_entropy(logits.reshape(-1, 8), y.reshape(-1), ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        head.eval()
        counts = torch.zeros(3, device=device, dtype=torch.long)   # q8 correct, q3 correct, residues
        with torch.no_grad():
            for tokens, y in valid_loader:
                tokens, y = tokens.to(device), y.to(device)
                pred = head.module(embed(backbone, tokens, layer, y.shape[1])).argmax(-1)
                ok = y != -100
                counts[0] += ((pred == y) & ok).sum()
                counts[1] += ((ss3_map[pred] == ss3_map[y.clamp(min=0)]) & ok).sum()
                counts[2] += ok.sum()
        dist.all_reduce(counts)
        q8, q3 = counts[0].item() / counts[2].item(), counts[1].item() / counts[2].item()
        if rank == 0:
            print(f"epoch {epoch} done ({time.time() - t0:.0f}s): Q8 {q8:.4f} Q3 {q3:.4f}", flush=True)
            best_q3 = max(best_q3, q3)
            state = {"head": head.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_q3": best_q3}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if q3 >= best_q3:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
