"""Step-based forward-synthesis training with preemption-safe resume.

Jobs on the shared queue get preempted every few hours; the launcher script
re-submits with --resume pointing at the latest checkpoint.

torchrun --nproc_per_node=8 09_forward_step_training.py --data data/uspto_mit --resume runs/fwd/latest.pt
"""
import argparse
import glob
import math
import os
import random
import re
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

RDLogger.DisableLog("rdApp.*")
SMILES_RE = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")

STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


class FwdData(Dataset):
    def __init__(self, path, stoi, augment):
        self.rows = []
        with open(path) as f:
            for line in f:
                rxn = line.strip().split()[0]
                reactants, reagents, product = rxn.split(">")
                src = reactants + ("." + reagents if reagents else "")
                self.rows.append((src, product))
        self.stoi, self.augment = stoi, augment

    def __len__(self):
        return len(self.rows)

    def encode(self, smi):
        return [1] + [self.stoi.get(t, 3) for t in SMILES_RE.findall(smi)] + [2]

    def __getitem__(self, i):
        src, tgt = self.rows[i]
        if self.augment:
            frags = []
            for s in src.split("."):
                m = Chem.MolFromSmiles(s)
                frags.append(Chem.MolToSmiles(m, doRandom=True, canonical=False) if m else s)
            random.shuffle(frags)
            src = ".".join(frags)
        return torch.tensor(self.encode(src)), torch.tensor(self.encode(tgt))


def collate(b):
    s, t = zip(*b)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, V, d=512, L=6, H=8, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, 512, d))
        nn.init.normal_(self.pos, std=0.02)
        self.net = nn.Transformer(d, H, L, L, 4 * d, p, batch_first=True, norm_first=True)
        self.head = nn.Linear(d, V)

    def forward(self, src, tgt):
        e = lambda x: self.emb(x) * math.sqrt(self.d) + self.pos[:, : x.size(1)]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.net(e(src), e(tgt), tgt_mask=mask, src_key_padding_mask=src.eq(0),
                     tgt_key_padding_mask=tgt.eq(0), memory_key_padding_mask=src.eq(0))
        return self.head(h)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))


def save_ckpt(path, model, opt, scaler, step, epoch):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                "step": step, "epoch": epoch}, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    ce = nn.CrossEntropyLoss(ignore_index=0, reduction="sum")
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(src, tgt[:, :-1])
        acc[0] += ce(out.float().flatten(0, 1), tgt[:, 1:].flatten())
        acc[1] += tgt[:, 1:].ne(0).sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", default="runs/fwd")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_steps", type=int, default=300000)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--eval_every", type=int, default=10000)
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = f.read().split("\n")
    stoi = {t: i for i, t in enumerate(itos) if t}
    train_ds = FwdData(os.path.join(args.data, "train.txt"), stoi, augment=True)
    val_ds = FwdData(os.path.join(args.data, "valid.txt"), stoi, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 128, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    model = DDP(Seq2SeqTransformer(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)

    step, epoch = 0, 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        step, epoch = ckpt["step"], ckpt["epoch"]
        del ckpt
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    model.train()
    done = False
    while not done:
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (src, tgt) in enumerate(train_dl):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(src, tgt[:, :-1])
                loss = crit(out.float().flatten(0, 1), tgt[:, 1:].flatten())
            scaler.scale(loss).backward()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} ep {epoch} loss {loss.item():.4f} lr {lr_at(step, args):.2e} "
                      f"{(it + 1) / (time.time() - t0):.1f} it/s", flush=True)
            if step % args.eval_every == 0:
                vl = eval_loss(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} valid loss/token {vl:.4f}", flush=True)

            stop_now = torch.tensor(float(STOP), device=device)
            dist.all_reduce(stop_now, op=dist.ReduceOp.MAX)
            if step % args.save_every == 0 or stop_now.item() > 0 or step >= args.max_steps:
                if rank == 0:
                    save_ckpt(os.path.join(args.run_dir, "latest.pt"), model, opt, scaler, step, epoch)
                    if step % args.save_every == 0:
                        save_ckpt(os.path.join(args.run_dir, f"step_{step}.pt"), model, opt, scaler, step, epoch)
                dist.barrier()
            if stop_now.item() > 0 or step >= args.max_steps:
                done = True
                break
        epoch += 1

    if rank == 0:
        for old in sorted(glob.glob(os.path.join(args.run_dir, "step_*.pt")), key=os.path.getmtime)[:-5]:
            os.remove(old)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
