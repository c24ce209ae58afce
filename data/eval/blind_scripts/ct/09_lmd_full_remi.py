"""Small Llama-style decoder on REMI tokens of the full Lakh MIDI dataset.

Pre-tokenised pieces (one .npy per MIDI file, REMI + programs) come from scripts/pretok_lmd.py.

torchrun --nproc_per_node=8 09_lmd_full_remi.py --tokens data/lmd_full_remi --tokenizer data/lmd_full_remi/tokenizer.json
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from miditok import REMI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import LlamaConfig, LlamaForCausalLM


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class LMDWindows(Dataset):
    def __init__(self, files, seq_len, pad_id, pitch_lo=None, pitch_hi=None, max_shift=0, min_len=256):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.pitch_lo, self.pitch_hi, self.max_shift = pitch_lo, pitch_hi, max_shift
        self.pieces, self.index = [], []
        for f in files:
            a = np.load(f, mmap_mode="r")
            if len(a) < min_len:
                continue
            k = len(self.pieces)
            self.pieces.append(a)
            self.index.extend((k, s) for s in range(0, len(a) - seq_len // 4, seq_len))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        k, s = self.index[i]
        w = np.array(self.pieces[k][s:s + self.seq_len], dtype=np.int64)
        if self.max_shift:
            m = (w >= self.pitch_lo) & (w <= self.pitch_hi)
            if m.any():
                shift = np.random.randint(-self.max_shift, self.max_shift + 1)
                if w[m].min() + shift >= self.pitch_lo and w[m].max() + shift <= self.pitch_hi:
                    w[m] += shift
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        ids[:len(w)] = w
        ids = torch.from_numpy(ids)
        return {"input_ids": ids, "attention_mask": (ids != self.pad_id).long()}


@torch.no_grad()
def evaluate(net, loader, device, pad_id, pitch_lo, pitch_hi):
    net.eval()
    t = torch.zeros(4, dtype=torch.float64, device=device)
    for b in loader:
        ids, am = b["input_ids"].to(device), b["attention_mask"].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(input_ids=ids, attention_mask=am).logits[:, :-1].float()
        y = ids[:, 1:]
        t[0] += F.cross_entropy(logits.transpose(1, 2), y, ignore_index=pad_id, reduction="sum")
        t[1] += (y != pad_id).sum()
        pm = (y >= pitch_lo) & (y <= pitch_hi)
        t[2] += ((logits.argmax(-1) == y) & pm).sum()
        t[3] += pm.sum()
    dist.all_reduce(t)
    net.train()
    return math.exp(t[0] / t[1]), (t[2] / t[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="runs/lmd_llama")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min_lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--val_frac", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)  # different augmentation / dropout stream on every rank

    tok = REMI(params=args.tokenizer)
    pad_id = tok["PAD_None"]
    pitch_tok = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    lo, hi = pitch_tok[0], pitch_tok[-1]

    files = sorted(glob.glob(os.path.join(args.tokens, "**", "*.npy"), recursive=True))
    random.shuffle(files)
    n_val = int(len(files) * args.val_frac)
    val_files, train_files = files[:n_val], files[n_val:]

    train_set = LMDWindows(train_files, args.seq_len, pad_id, lo, hi, max_shift=5)
    val_set = LMDWindows(val_files, args.seq_len, pad_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=args.batch_size, num_workers=4)

    cfg = LlamaConfig(vocab_size=len(tok.vocab), hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, max_position_embeddings=args.seq_len, pad_token_id=pad_id,
                      bos_token_id=tok["BOS_None"], eos_token_id=tok["EOS_None"], rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    lr = args.lr * math.sqrt(world * args.batch_size / 64)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=True)
    total = args.epochs * len(train_loader)

    def lr_at(step):
        if step < args.warmup:
            return lr * (step + 1) / args.warmup
        prog = (step - args.warmup) / max(1, total - args.warmup)
        return args.min_lr + 0.5 * (lr - args.min_lr) * (1 + math.cos(math.pi * prog))

    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_files)} train / {len(val_files)} val pieces, {len(train_set)} windows", flush=True)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for batch in train_loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            ids = batch["input_ids"].to(device, non_blocking=True)
            am = batch["attention_mask"].to(device, non_blocking=True)
            labels = ids.masked_fill(am == 0, -100)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", lr_at(step), step)
                print(f"step {step}/{total} loss {loss.item():.4f} {(time.time() - tic) / 100:.2f}s/it", flush=True)
                tic = time.time()

        ppl, pitch_acc = evaluate(model.module, val_loader, device, pad_id, lo, hi)
        if rank == 0:
            writer.add_scalar("val/ppl", ppl, epoch)
            writer.add_scalar("val/pitch_acc", pitch_acc, epoch)
            print(f"epoch {epoch} val ppl {ppl:.3f} pitch acc {pitch_acc:.4f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, "last"))
            if ppl < best:
                best = ppl
                model.module.save_pretrained(os.path.join(args.out, "best"))
            net = model.module.eval()
            gen = net.generate(torch.tensor([[tok["BOS_None"]]], device=device), max_new_tokens=1536,
                               do_sample=True, top_k=40, temperature=1.0, pad_token_id=pad_id)
            net.train()
            tok.decode(gen[0].tolist()).dump_midi(os.path.join(args.out, f"sample_epoch{epoch}.mid"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
