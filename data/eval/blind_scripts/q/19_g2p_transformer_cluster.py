"""
Grapheme-to-phoneme transformer trained on a large pronunciation lexicon (CMUdict + in-house entries).
Runs on one GPU or distributed.

cluster job (jobs/g2p.sbatch):
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    srun python 19_g2p_transformer_cluster.py --lexicon data/lexicon.tsv --out exp/g2p_big
"""
import argparse
import math
import os
import random
import time

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PAD, SOS, EOS = 0, 1, 2


def setup_distributed():
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if world_size > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def is_dist():
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t):
    if is_dist():
        dist.all_reduce(t)
    return t


def load_lexicon(path):
    entries = []
    for line in open(path, encoding="utf-8"):
        word, pron = line.rstrip("\n").split("\t")
        entries.append((word.lower(), pron.split()))
    return entries


def build_symbols(entries):
    graphemes = sorted({c for w, _ in entries for c in w})
    phonemes = sorted({p for _, pr in entries for p in pr})
    g2i = {c: i + 3 for i, c in enumerate(graphemes)}
    p2i = {p: i + 3 for i, p in enumerate(phonemes)}
    return g2i, p2i


def make_collate(g2i, p2i):
    def collate(batch):
        src = [torch.tensor([g2i[c] for c in w] + [EOS]) for w, _ in batch]
        tgt = [torch.tensor([p2i[p] for p in pr]) for _, pr in batch]
        tin = [torch.cat([torch.tensor([SOS]), t]) for t in tgt]
        tout = [torch.cat([t, torch.tensor([EOS])]) for t in tgt]
        pad = lambda xs, v: nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=v)
        return pad(src, PAD), pad(tin, PAD), pad(tout, -100)
    return collate


class G2PTransformer(nn.Module):
    def __init__(self, n_g, n_p, d=256, layers=4, heads=4, ff=1024, drop=0.1, max_len=64):
        super().__init__()
        self.src_emb = nn.Embedding(n_g, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(n_p, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.tf = nn.Transformer(d, heads, layers, layers, ff, drop, batch_first=True)
        self.out = nn.Linear(d, n_p)

    def forward(self, src, tin):
        ps = self.pos(torch.arange(src.size(1), device=src.device))
        pt = self.pos(torch.arange(tin.size(1), device=src.device))
        mask = self.tf.generate_square_subsequent_mask(tin.size(1)).to(src.device)
        h = self.tf(self.src_emb(src) + ps, self.tgt_emb(tin) + pt, tgt_mask=mask,
                    src_key_padding_mask=src.eq(PAD), tgt_key_padding_mask=tin.eq(PAD),
                    memory_key_padding_mask=src.eq(PAD))
        return self.out(h)

    @torch.no_grad()
    def greedy(self, src, max_len=40):
        ys = torch.full((src.size(0), 1), SOS, dtype=torch.long, device=src.device)
        for _ in range(max_len):
            nxt = self.forward(src, ys)[:, -1].argmax(-1, keepdim=True)
            ys = torch.cat([ys, nxt], 1)
            if (ys == EOS).any(1).all():
                break
        return ys[:, 1:]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)  # phone errs, phones, word errs, words
    for src, _, tout in loader:
        src = src.to(device)
        hyp = model.greedy(src).tolist()
        for h, r in zip(hyp, tout.tolist()):
            h = h[: h.index(EOS)] if EOS in h else h
            r = [t for t in r if t not in (-100, EOS)]
            e = editdistance.eval(h, r)
            s[0] += e
            s[1] += len(r)
            s[2] += int(e > 0)
            s[3] += 1
    all_reduce_sum(s)
    model.train()
    return (100 * s[0] / s[1]).item(), (100 * s[2] / s[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lexicon", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bsz", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dev-size", type=int, default=5000)
    args = ap.parse_args()

    rank, world, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)

    entries = load_lexicon(args.lexicon)
    random.Random(0).shuffle(entries)
    dev, train = entries[: args.dev_size], entries[args.dev_size:]
    g2i, p2i = build_symbols(entries)
    collate = make_collate(g2i, p2i)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=2,
                          drop_last=True)
    dev_dl = DataLoader(Subset(dev, range(rank, len(dev), world)), batch_size=512, collate_fn=collate)

    torch.manual_seed(0)
    net = G2PTransformer(len(g2i) + 3, len(p2i) + 3).to(device)
    model = DDP(net, device_ids=[local_rank]) if world > 1 else net
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    warm = 4000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, math.sqrt(warm / (s + 1))))

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"world={world} train={len(train)} dev={len(dev)} graphemes={len(g2i)} phonemes={len(p2i)}")

    best_wer, step = 1e9, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for src, tin, tout in train_dl:
            src, tin, tout = src.to(device), tin.to(device), tout.to(device)
            logits = model(src, tin)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), tout.view(-1), ignore_index=-100,
                                   label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if writer and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        per, wer = evaluate(net, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch} PER {per:.2f} WER {wer:.2f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("dev/per", per, epoch)
            writer.add_scalar("dev/wer", wer, epoch)
            state = {"model": net.state_dict(), "g2i": g2i, "p2i": p2i, "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(state, os.path.join(args.out, "best.pt"))
        if is_dist():
            dist.barrier()

    if writer:
        writer.close()
    if is_dist():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
