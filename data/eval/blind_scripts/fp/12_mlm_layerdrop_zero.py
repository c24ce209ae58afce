"""Masked-LM pretraining of a 24-layer encoder with LayerDrop.

DDP + ZeroRedundancyOptimizer + activation checkpointing, two nodes:
    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=4 --rdzv-id=mlm24 \
        --rdzv-backend=c10d --rdzv-endpoint=$MASTER_HOST:29400 12_mlm_layerdrop_zero.py ...
"""
import argparse
import math
import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, CLS, SEP, MASK = 0, 101, 102, 103

_terminate = False


def _sigterm(signum, frame):
    global _terminate
    _terminate = True


class Blocks(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.memmap(path, dtype=np.int32, mode="r").reshape(-1, seq_len)

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[i].astype(np.int64))


class MaskCollator:
    def __init__(self, vocab, p=0.15):
        self.vocab, self.p = vocab, p

    def __call__(self, rows):
        ids = torch.stack(rows)
        labels = ids.clone()
        special = (ids == PAD) | (ids == CLS) | (ids == SEP)
        pick = (torch.rand(ids.shape) < self.p) & ~special
        labels[~pick] = -100
        r = torch.rand(ids.shape)
        ids[pick & (r < 0.8)] = MASK
        rand_pos = pick & (r >= 0.8) & (r < 0.9)
        ids[rand_pos] = torch.randint(1000, self.vocab, (int(rand_pos.sum()),))
        return ids, labels


class Encoder(nn.Module):
    def __init__(self, vocab, seq_len, dim=1024, depth=24, heads=16, layerdrop=0.1, grad_ckpt=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)
        self.layerdrop = layerdrop
        self.grad_ckpt = grad_ckpt

    def forward(self, ids):
        pad_mask = ids == PAD
        x = self.emb(ids) + self.pos[:, : ids.size(1)]
        for layer in self.layers:
            if self.training and torch.rand(()) < self.layerdrop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, None, pad_mask, use_reentrant=False)
            else:
                x = layer(x, src_key_padding_mask=pad_mask)
        return self.lm_head(self.norm(x))


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--peak-lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=10000)
    ap.add_argument("--total-steps", type=int, default=250000)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def main():
    args = args_()
    signal.signal(signal.SIGTERM, _sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0
    per_rank_bs = args.global_batch // world

    torch.manual_seed(args.seed)
    model = Encoder(args.vocab, args.seq_len).to(device)
    torch.manual_seed(args.seed + rank)  # LayerDrop / masking draws differ per rank
    # LayerDrop skips whole layers, so some parameters get no gradient in a step
    ddp = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=args.peak_lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, max(0.0, (args.total_steps - s) / (args.total_steps - args.warmup))))

    train = Blocks(args.train, args.seq_len)
    valid = Blocks(args.valid, args.seq_len)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    collate = MaskCollator(args.vocab)
    valid_loader = DataLoader(valid, batch_size=per_rank_bs, collate_fn=collate, num_workers=2,
                              sampler=DistributedSampler(valid, shuffle=False, drop_last=True))

    step, epoch, consumed = 0, 0, 0  # consumed = samples of this epoch already trained on
    path = os.path.join(args.save_dir, "latest.pt")
    if os.path.exists(path):
        st = torch.load(path, map_location="cpu")
        model.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        step, epoch, consumed = st["step"], st["epoch"], st["consumed"]
        if rank == 0:
            print(f"resumed at step {step} (epoch {epoch}, {consumed} samples into it)", flush=True)

    def save():
        optimizer.consolidate_state_dict(to=0)  # collective: every rank must take part
        if rank == 0:
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                        "sched": sched.state_dict(), "step": step, "epoch": epoch,
                        "consumed": consumed}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()

    @torch.no_grad()
    def validate():
        ddp.eval()
        tot = torch.zeros(2, device=device)
        for ids, labels in valid_loader:
            ids, labels = ids.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(ids)
            tot[0] += F.cross_entropy(logits.float().view(-1, args.vocab), labels.view(-1),
                                      ignore_index=-100, reduction="sum")
            tot[1] += (labels != -100).sum()
        dist.all_reduce(tot)
        ddp.train()
        return (tot[0] / tot[1]).item()

    ddp.train()
    done = False
    while not done:
        sampler.set_epoch(epoch)
        loader = DataLoader(train, batch_size=per_rank_bs, sampler=sampler, collate_fn=collate,
                            num_workers=4, pin_memory=True, drop_last=True)
        it = iter(loader)
        for _ in range(consumed // args.global_batch):
            next(it)
        t0 = time.time()
        for ids, labels in it:
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(ids)
                loss = F.cross_entropy(logits.float().view(-1, args.vocab), labels.view(-1), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed += args.global_batch

            if step % 100 == 0:
                rep = loss.detach()
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} mlm_loss {rep.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 100:.2f}s/step", flush=True)
                    t0 = time.time()

            term = torch.tensor(int(_terminate), device=device)
            dist.all_reduce(term, op=dist.ReduceOp.MAX)
            if term.item() or step % args.save_every == 0 or step >= args.total_steps:
                save()
            if step % 10000 == 0:
                vl = validate()
                if rank == 0:
                    print(f"step {step} valid_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if term.item() or step >= args.total_steps:
                done = True
                break
        else:
            epoch += 1
            consumed = 0

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
