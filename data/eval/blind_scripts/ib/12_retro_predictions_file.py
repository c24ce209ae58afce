"""Retrosynthesis transformer; at every evaluation the beam-search outputs of all
ranks are collected on rank 0, which writes a predictions file (one line per
target, tab separated top-k candidates) and scores it.

torchrun --nproc_per_node=8 12_retro_predictions_file.py --data data/uspto50k_aug --out runs/retro_preds
"""
import argparse
import logging
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
log = logging.getLogger(__name__)
TOKEN = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def canon(s):
    m = Chem.MolFromSmiles(s)
    return Chem.MolToSmiles(m) if m else ""


class SrcTgt(Dataset):
    def __init__(self, root, split, stoi):
        with open(os.path.join(root, f"src-{split}.txt")) as a, open(os.path.join(root, f"tgt-{split}.txt")) as b:
            self.src = ["".join(l.split()) for l in a]
            self.tgt = ["".join(l.split()) for l in b]
        self.stoi = stoi

    def __len__(self):
        return len(self.src)

    def _ids(self, s):
        return [1] + [self.stoi.get(t, 3) for t in TOKEN.findall(s)] + [2]

    def __getitem__(self, i):
        return torch.tensor(self._ids(self.src[i])), torch.tensor(self._ids(self.tgt[i])), i


def collate(batch):
    s, t, i = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class Retro(nn.Module):
    def __init__(self, V, d=256, L=6, H=8, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 512, d) * 0.02)
        self.tr = nn.Transformer(d, H, L, L, 2048, p, batch_first=True)
        self.lm = nn.Linear(d, V)

    def _e(self, x):
        return self.emb(x) * math.sqrt(self.d) + self.pos[:, : x.size(1)]

    def encode(self, src):
        return self.tr.encoder(self._e(src), src_key_padding_mask=src.eq(0))

    def decode(self, y, mem, mpad):
        cm = nn.Transformer.generate_square_subsequent_mask(y.size(1), device=y.device)
        return self.lm(self.tr.decoder(self._e(y), mem, tgt_mask=cm, tgt_key_padding_mask=y.eq(0),
                                       memory_key_padding_mask=mpad))

    def forward(self, src, tgt):
        return self.decode(tgt, self.encode(src), src.eq(0))


@torch.no_grad()
def beam_search(net, src, k, max_len=200):
    B, dev = src.size(0), src.device
    mem, mpad = net.encode(src).repeat_interleave(k, 0), src.eq(0).repeat_interleave(k, 0)
    y = torch.ones(B * k, 1, dtype=torch.long, device=dev)
    sc = torch.full((B, k), float("-inf"), device=dev)
    sc[:, 0] = 0
    fin = torch.zeros(B * k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(y, mem, mpad)[:, -1], -1)
        lp[fin] = float("-inf")
        lp[fin, 0] = 0
        V = lp.size(1)
        sc, fl = (sc.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        par = (fl.div(V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
        y = torch.cat([y[par], (fl % V).view(-1, 1)], 1)
        fin = fin[par] | y[:, -1].eq(2)
        if fin.all():
            break
    return y.view(B, k, -1)


def ids2smi(ids, itos):
    out = []
    for t in ids[1:]:
        if t == 2:
            break
        if t > 3:
            out.append(itos[t])
    return "".join(out)


@torch.no_grad()
def evaluate(net, loader, ds, itos, device, k, pred_path):
    net.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    collected = {}
    for src, _, idx in loader:
        beams = beam_search(net, src.to(device), k)
        idx = idx.to(device)
        all_beams = [torch.zeros_like(beams) for _ in range(world)]
        all_idx = [torch.zeros_like(idx) for _ in range(world)]
        dist.all_gather(all_beams, beams)
        dist.all_gather(all_idx, idx)
        if rank == 0:
            for bb, ii in zip(all_beams, all_idx):
                for seqs, i in zip(bb.tolist(), ii.tolist()):
                    collected[i] = [ids2smi(s, itos) for s in seqs]
    net.train()
    if rank != 0:
        return None
    hits = [0] * k
    with open(pred_path, "w") as f:
        for i in sorted(collected):
            cands = collected[i]
            f.write("\t".join(cands) + "\n")
            gold = canon(ds.tgt[i])
            canon_cands = [canon(c) for c in cands]
            if gold in canon_cands:
                for j in range(canon_cands.index(gold), k):
                    hits[j] += 1
    n = len(collected)
    return {f"top{j + 1}": hits[j] / n for j in (0, 2, 4, 9) if j < k}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/retro_preds")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--eval_every", type=int, default=20)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = [line.split()[0] for line in f if line.strip()]
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds, val_ds = SrcTgt(args.data, "train", stoi), SrcTgt(args.data, "val", stoi)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 50, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    model = DDP(Retro(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=len(train_dl) * 20)
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    log.info("train=%d val=%d vocab=%d", len(train_ds), len(val_ds), len(itos))

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=device)
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(total)
        log.info("epoch %d train loss %.4f", epoch, (total[0] / total[1]).item())

        if (epoch + 1) % args.eval_every == 0:
            res = evaluate(model.module, val_dl, val_ds, itos, device, args.beam,
                           os.path.join(args.out, f"val_pred_ep{epoch}.txt"))
            if rank == 0:
                log.info("epoch %d %s", epoch, res)
                if res["top1"] > best:
                    best = res["top1"]
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
