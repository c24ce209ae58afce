"""Preemptible transformer-base En-De training: saves often and resumes from checkpoint_last.pt.

Meant for a queue that kills jobs after 4h; the same command line picks up where it stopped.

    torchrun --nproc_per_node=8 19_resume_ende_base.py --data data/wmt16_ende --save-dir /nfs/ckpt/ende_base
"""
import argparse
import contextlib
import math
import os
import signal
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--update-freq", type=int, default=2)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=150000)
    p.add_argument("--save-interval-updates", type=int, default=1000)
    p.add_argument("--validate-interval-updates", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class PairSet(Dataset):
    def __init__(self, prefix, sp, max_len=250):
        with open(prefix + ".en") as f1, open(prefix + ".de") as f2:
            self.pairs = [(sp.encode(a.rstrip("\n"))[:max_len], sp.encode(b.rstrip("\n"))[:max_len], b.rstrip("\n"))
                          for a, b in zip(f1, f2)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def collate(batch, pad=0, bos=1, eos=2):
    S = 1 + max(len(b[0]) for b in batch)
    T = 1 + max(len(b[1]) for b in batch)
    src = torch.full((len(batch), S), pad)
    inp = torch.full((len(batch), T), pad)
    out = torch.full((len(batch), T), pad)
    for i, (s, t, _) in enumerate(batch):
        src[i, : len(s) + 1] = torch.tensor(s + [eos])
        inp[i, : len(t) + 1] = torch.tensor([bos] + t)
        out[i, : len(t) + 1] = torch.tensor(t + [eos])
    return src, inp, out, [b[2] for b in batch]


class Model(nn.Module):
    def __init__(self, V, d=512, h=8, f=2048, n=6, p=0.1, pad=0):
        super().__init__()
        self.pad = pad
        self.tok = nn.Embedding(V, d, padding_idx=pad)
        self.pos = nn.Embedding(512, d)
        self.body = nn.Transformer(d, h, n, n, f, p, batch_first=True)
        self.drop = nn.Dropout(p)
        self.d = d

    def emb(self, x):
        return self.drop(self.tok(x) * self.d ** 0.5 + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        return self.body.encoder(self.emb(src), src_key_padding_mask=src.eq(self.pad))

    def decode(self, inp, mem, src):
        T = inp.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=inp.device), 1)
        h = self.body.decoder(self.emb(inp), mem, tgt_mask=causal, tgt_key_padding_mask=inp.eq(self.pad),
                              memory_key_padding_mask=src.eq(self.pad))
        return F.linear(h, self.tok.weight)

    def forward(self, src, inp):
        return self.decode(inp, self.encode(src), src)


def smoothed_xent(logits, out, eps=0.1, pad=0):
    lp = F.log_softmax(logits.float(), -1)
    m = out.ne(pad)
    nll = -lp.gather(-1, out.unsqueeze(-1)).squeeze(-1)
    eps_i = eps / (lp.size(-1) - 1)
    return ((1 - eps - eps_i) * nll - eps_i * lp.sum(-1))[m].sum(), nll[m].sum(), m.sum()


@torch.no_grad()
def greedy(net, src, extra=50, bos=1, eos=2):
    mem = net.encode(src)
    ys = torch.full((src.size(0), 1), bos, dtype=torch.long, device=src.device)
    for _ in range(src.size(1) + extra):
        ys = torch.cat([ys, net.decode(ys, mem, src)[:, -1].argmax(-1, keepdim=True)], 1)
        if ys.eq(eos).any(1).all():
            break
    return [r[: r.index(eos)] if eos in r else r for r in ys[:, 1:].tolist()]


def main():
    args = args_()
    signal.signal(signal.SIGTERM, _on_sigterm)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm.model"))
    train = PairSet(os.path.join(args.data, "train"), sp)
    valid = PairSet(os.path.join(args.data, "newstest2013"), sp)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True)

    model = DDP(Model(sp.get_piece_size()).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min((u + 1) / W, math.sqrt(W / (u + 1))))

    last_ckpt = os.path.join(args.save_dir, "checkpoint_last.pt")
    updates, epoch, skip_batches = 0, 0, 0
    if os.path.isfile(last_ckpt):
        state = torch.load(last_ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["lr_scheduler"])
        updates, epoch, skip_batches = state["updates"], state["epoch"], state["batches_in_epoch"]
        del state
        if rank == 0:
            print(f"| restored {last_ckpt}: update {updates}, epoch {epoch}, batch {skip_batches}", flush=True)
    elif rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    def save(batches_in_epoch):
        if rank == 0:
            tmp = last_ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "lr_scheduler": sched.state_dict(), "updates": updates, "epoch": epoch,
                        "batches_in_epoch": batches_in_epoch}, tmp)
            os.replace(tmp, last_ckpt)
        dist.barrier()

    t0 = time.time()
    while updates < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        for b, (src, inp, out, _) in enumerate(loader):
            if b < skip_batches:
                continue
            src, inp, out = src.to(device), inp.to(device), out.to(device)
            boundary = (b + 1) % args.update_freq == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, inp)
                loss, nll, ntok = smoothed_xent(logits, out)
                (loss / ntok / args.update_freq).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1
            if rank == 0 and updates % 100 == 0:
                print(f"| upd {updates} | ep {epoch} | nll {(nll / ntok).item():.3f} | "
                      f"lr {sched.get_last_lr()[0]:.2e} | {time.time() - t0:.0f}s", flush=True)

            # any rank that got SIGTERM makes everybody checkpoint and exit
            flag = torch.tensor([float(STOP)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if updates % args.save_interval_updates == 0 or flag.item() > 0:
                save(b + 1)
                if flag.item() > 0:
                    dist.destroy_process_group()
                    return

            if updates % args.validate_interval_updates == 0 and rank == 0:
                net = model.module
                net.eval()
                hyps, refs = [], []
                for k in range(0, len(valid), 100):
                    src_v, _, _, ref = collate([valid[i] for i in range(k, min(k + 100, len(valid)))])
                    hyps += [sp.decode(h) for h in greedy(net, src_v.to(device))]
                    refs += ref
                net.train()
                print(f"| valid | upd {updates} | BLEU {sacrebleu.corpus_bleu(hyps, [refs]).score:.2f}", flush=True)
            if updates >= args.max_update:
                break
        skip_batches = 0
        epoch += 1

    save(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
