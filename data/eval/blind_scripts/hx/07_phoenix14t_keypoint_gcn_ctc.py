"""Gloss recognition on PHOENIX-2014T from COCO-WholeBody keypoints (HRNet-w48, 133 joints).

Spatial GCN per frame -> temporal conv -> BiGRU -> CTC. Dev/test hypotheses are collected on
rank 0 and written as .ctm so they can be scored with the official sclite scripts as well.

    torchrun --nproc_per_node=4 07_phoenix14t_keypoint_gcn_ctc.py --data /data/p14t --out exp/kp_gcn
"""
import argparse
import os
import pickle
import random

import jiwer
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# 11 upper-body joints, 21 + 21 hand joints, 10 mouth points of COCO-WholeBody
BODY = [0, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
MOUTH = [71, 73, 75, 77, 79, 81, 83, 85, 87, 89]
LHAND = list(range(91, 112))
RHAND = list(range(112, 133))
JOINTS = BODY + MOUTH + LHAND + RHAND


def hand_edges(offset):
    e = []
    for f in range(5):
        base = offset + 1 + 4 * f
        e.append((offset, base))
        e += [(base + k, base + k + 1) for k in range(3)]
    return e


def build_graph():
    n = len(JOINTS)
    edges = [(0, 1), (0, 2), (1, 3), (3, 5), (2, 4), (4, 6), (1, 2), (1, 7), (2, 8), (0, 9), (0, 10)]
    edges += [(0, 11 + k) for k in range(0, 10, 3)] + [(11 + k, 11 + k + 1) for k in range(9)]
    lh, rh = len(BODY) + len(MOUTH), len(BODY) + len(MOUTH) + 21
    edges += hand_edges(lh) + hand_edges(rh) + [(5, lh), (6, rh)]
    A = torch.eye(n)
    for i, j in edges:
        A[i, j] = A[j, i] = 1.0
    d = A.sum(1).pow(-0.5)
    return d[:, None] * A * d[None, :]


class KeypointGlossSet(Dataset):
    def __init__(self, root, split, vocab, train):
        with open(os.path.join(root, f"{split}.pkl"), "rb") as f:
            self.data = pickle.load(f)  # list of {"name", "keypoints": (T,133,3), "gloss"}
        self.vocab = vocab
        self.train = train

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        item = self.data[idx]
        kp = item["keypoints"][:, JOINTS].astype(np.float32)
        xy, conf = kp[..., :2], kp[..., 2:]
        xy = (xy - xy[:, :1]) / 256.0  # nose-centred, normalised by the crop size
        if self.train:
            xy = xy * np.random.uniform(0.8, 1.2) + np.random.normal(0, 0.005, xy.shape)
            if random.random() < 0.5:
                t = len(xy)
                keep = np.sort(np.random.choice(t, max(16, int(t * random.uniform(0.8, 1.0))), replace=False))
                xy, conf = xy[keep], conf[keep]
        x = torch.from_numpy(np.concatenate([xy, conf], -1).astype(np.float32))  # T, V, 3
        y = torch.tensor([self.vocab[g] for g in item["gloss"].split()], dtype=torch.long)
        return x, y, idx


def collate(batch):
    xs, ys, idx = zip(*batch)
    lens = torch.tensor([x.shape[0] for x in xs])
    return nn.utils.rnn.pad_sequence(xs, batch_first=True), lens, torch.cat(ys), torch.tensor([len(y) for y in ys]), list(idx)


class GCNLayer(nn.Module):
    def __init__(self, cin, cout, A):
        super().__init__()
        self.register_buffer("A", A)
        self.lin = nn.Linear(cin, cout)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):  # B T V C
        x = torch.einsum("vw,btwc->btvc", self.A, self.lin(x))
        b, t, v, c = x.shape
        return F.relu(self.bn(x.reshape(-1, c)).view(b, t, v, c))


class KeypointCTC(nn.Module):
    def __init__(self, num_classes, A, hidden=512):
        super().__init__()
        self.gcn = nn.Sequential(GCNLayer(3, 64, A), GCNLayer(64, 64, A), GCNLayer(64, 128, A))
        v = A.shape[0]
        self.tconv = nn.Sequential(
            nn.Conv1d(128 * v, hidden, 5, padding=2), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.MaxPool1d(2, ceil_mode=True),
            nn.Conv1d(hidden, hidden, 5, padding=2), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.MaxPool1d(2, ceil_mode=True))
        self.rnn = nn.GRU(hidden, hidden // 2, num_layers=2, batch_first=True, bidirectional=True, dropout=0.2)
        self.cls = nn.Linear(hidden, num_classes)

    def forward(self, x, lens):
        h = self.gcn(x).flatten(2)  # B T V*C
        h = self.tconv(h.transpose(1, 2)).transpose(1, 2)
        lens = torch.div(torch.div(lens + 1, 2, rounding_mode="floor") + 1, 2, rounding_mode="floor")
        packed = nn.utils.rnn.pack_padded_sequence(h, lens.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=h.shape[1])
        return self.cls(h), lens


def greedy(logits, lens):
    out = []
    for seq, n in zip(logits.argmax(-1).tolist(), lens.tolist()):
        hyp, prev = [], 0
        for s in seq[:n]:
            if s != prev and s != 0:
                hyp.append(s)
            prev = s
        out.append(hyp)
    return out


@torch.no_grad()
def run_eval(model, dataset, loader, id2gloss, device, ctm_path):
    model.eval()
    flat = []
    for x, lens, _, _, idx in loader:
        logits, out_lens = model(x.to(device), lens.to(device))
        for i, hyp in zip(idx, greedy(logits, out_lens)):
            flat += [i] + hyp + [-1]  # -1 terminates one hypothesis
    local = torch.tensor(flat, dtype=torch.long, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    if dist.get_rank() != 0:
        return None
    hyps, cur = {}, []
    for tok in torch.cat(gathered).tolist():
        if tok == -1:
            hyps[cur[0]] = cur[1:]
            cur = []
        else:
            cur.append(tok)
    refs, preds = [], []
    with open(ctm_path, "w") as f:
        for i in sorted(hyps):
            item = dataset.data[i]
            words = [id2gloss[t] for t in hyps[i]]
            for k, w in enumerate(words):
                f.write(f"{item['name']} 1 {k * 0.01:.3f} 0.010 {w}\n")
            refs.append(item["gloss"])
            preds.append(" ".join(words) if words else "<empty>")
    return 100 * jiwer.wer(refs, preds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="exp/kp_gcn")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    with open(os.path.join(args.data, "gloss_vocab.txt")) as f:
        id2gloss = ["<blank>"] + [l.strip() for l in f if l.strip()]
    vocab = {g: i for i, g in enumerate(id2gloss)}

    train_set = KeypointGlossSet(args.data, "train", vocab, train=True)
    dev_set = KeypointGlossSet(args.data, "dev", vocab, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_set, args.bs, sampler=sampler, collate_fn=collate, num_workers=6, drop_last=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)), 8,
                        collate_fn=collate, num_workers=4)

    model = KeypointCTC(len(id2gloss), build_graph())
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    os.makedirs(args.out, exist_ok=True)
    best = 1e9
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, lens, ys, ylens, _) in enumerate(train_dl):
            logits, out_lens = model(x.to(device, non_blocking=True), lens.to(device))
            loss = ctc(logits.log_softmax(-1).transpose(0, 1), ys.to(device), out_lens, ylens.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} it {step} ctc {loss.item():.3f}", flush=True)
        sched.step()

        wer = run_eval(model, dev_set, dev_dl, id2gloss, device, os.path.join(args.out, f"dev_ep{epoch}.ctm"))
        if rank == 0:
            print(f"epoch {epoch} dev WER {wer:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "vocab": id2gloss},
                       os.path.join(args.out, "last.pt"))
            if wer < best:
                best = wer
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "vocab": id2gloss},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
