"""GPipe-style pipeline-parallel GPT training, written directly on send/recv.

One rank per stage: stage 0 holds the embeddings and reads the data, the last
stage holds the LM head and computes the loss. Each step splits the batch into
micro-batches, runs all forwards, then all backwards in reverse order.

    torchrun --nproc_per_node=4 pipe_gpt.py --data data/tokens_train.npy --val-data data/tokens_val.npy
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class TokenWindows(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.load(path, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    def __init__(self, args, stage, n_stages):
        super().__init__()
        per = args.n_layer // n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        if self.first:
            self.tok = nn.Embedding(args.vocab, args.d_model)
            self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList([Block(args.d_model, args.n_head) for _ in range(per)])
        if self.last:
            self.ln_f = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab, bias=False)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def pipeline_step(stage_mod, batch, args, rank, n_stages, device, train=True):
    """Runs one batch through the pipeline. Returns the mean loss on the last stage, else None."""
    first, last = rank == 0, rank == n_stages - 1
    act_shape = (args.micro_bs, args.seq_len, args.d_model)
    inputs, outputs, losses = [], [], []

    if first:
        x, y = batch
        xs, ys = x.chunk(args.n_micro), y.chunk(args.n_micro)

    for m in range(args.n_micro):
        if first:
            inp = xs[m].to(device, non_blocking=True)
        else:
            inp = torch.empty(act_shape, device=device)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_(train)
        with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.bfloat16):
            out = stage_mod(inp)
        if last:
            tgt = torch.empty((args.micro_bs, args.seq_len), dtype=torch.long, device=device)
            dist.recv(tgt, src=0)
            loss = F.cross_entropy(out.float().view(-1, args.vocab), tgt.view(-1))
            losses.append(loss)
        else:
            dist.send(out.detach().float().contiguous(), dst=rank + 1)
        if first and not last:
            dist.send(ys[m], dst=n_stages - 1)  # targets go straight to the loss stage
        inputs.append(inp)
        outputs.append(out)

    if train:
        for m in reversed(range(args.n_micro)):
            if last:
                (losses[m] / args.n_micro).backward()
            else:
                grad = torch.empty(act_shape, device=device)
                dist.recv(grad, src=rank + 1)
                outputs[m].backward(grad.to(outputs[m].dtype))
            if not first:
                dist.send(inputs[m].grad.contiguous(), dst=rank - 1)

    if last:
        return torch.stack([l.detach() for l in losses]).mean()
    return None


def clip_global_norm(params, max_norm, device):
    sq = torch.zeros(1, device=device)
    for p in params:
        if p.grad is not None:
            sq += p.grad.float().pow(2).sum()
    dist.all_reduce(sq)  # norm over all stages
    norm = sq.sqrt().item()
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-data", required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--n-micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--ckpt-dir", default="ckpt/pipe_gpt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, n_stages = dist.get_rank(), dist.get_world_size()
    assert args.n_layer % n_stages == 0
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    stage = Stage(args, rank, n_stages).to(device)
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    batch_size = args.micro_bs * args.n_micro
    train_it = val_loader = None
    if rank == 0:
        train_ds = TokenWindows(args.data, args.seq_len)
        loader = DataLoader(train_ds, batch_size=batch_size, shuffle=True, drop_last=True,
                            num_workers=4, pin_memory=True)

        def forever(dl):
            while True:
                yield from dl
        train_it = forever(loader)
        val_loader = DataLoader(TokenWindows(args.val_data, args.seq_len), batch_size=batch_size,
                                shuffle=False, drop_last=True)

    for step in range(args.steps):
        stage.train()
        batch = next(train_it) if rank == 0 else None
        opt.zero_grad(set_to_none=True)
        loss = pipeline_step(stage, batch, args, rank, n_stages, device, train=True)
        gnorm = clip_global_norm(stage.parameters(), 1.0, device)
        opt.step()
        sched.step()
        if step % 50 == 0 and rank == n_stages - 1:
            print(f"step {step} loss {loss.item():.4f} gnorm {gnorm:.2f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        if (step + 1) % args.eval_every == 0:
            stage.eval()
            tot = torch.zeros(1, device=device)
            val_iter = iter(val_loader) if rank == 0 else None
            for _ in range(args.eval_batches):
                vb = next(val_iter) if rank == 0 else None
                vl = pipeline_step(stage, vb, args, rank, n_stages, device, train=False)
                if vl is not None:
                    tot += vl
            if rank == n_stages - 1:
                print(f"step {step + 1} val_loss {(tot / args.eval_batches).item():.4f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"stage": rank, "n_stages": n_stages, "model": stage.state_dict(),
                        "opt": opt.state_dict(), "step": step + 1},
                       os.path.join(args.ckpt_dir, f"stage{rank}_of{n_stages}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
