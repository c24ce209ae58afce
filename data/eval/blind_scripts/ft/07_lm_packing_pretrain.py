"""Causal LM pretraining on packed documents.

Whole documents are packed into fixed rows of --seq-len tokens; attention and positions
restart at every document boundary, and the loss is averaged over real target tokens
across all GPUs (rows carry different numbers of targets because of the tail padding).

    torchrun --nproc_per_node=8 07_lm_packing_pretrain.py --data data/tok/web_en --out ckpt/lm_350m
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_packs(doc_lens, seq_len):
    """Greedy packing of documents (in corpus order) into rows of at most seq_len tokens.
    Documents longer than a row are cut into row-sized pieces. Returns a list of rows,
    each a list of (doc_start, n_tokens)."""
    offsets = np.concatenate([[0], np.cumsum(doc_lens)])
    rows, cur, used = [], [], 0
    for d, n in enumerate(doc_lens):
        start = int(offsets[d])
        while n > 0:
            take = min(n, seq_len - used)
            cur.append((start, take))
            used += take
            start += take
            n -= take
            if used == seq_len:
                rows.append(cur)
                cur, used = [], 0
    if cur:
        rows.append(cur)
    return rows


class PackedDataset(Dataset):
    def __init__(self, prefix, seq_len, pad_id):
        self.tokens = np.load(prefix + ".tokens.npy", mmap_mode="r")
        self.doc_lens = np.load(prefix + ".doclens.npy")
        self.rows = build_packs(self.doc_lens, seq_len)
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, -100, dtype=np.int64)
        pos = np.zeros(self.seq_len, dtype=np.int64)
        seg = np.full(self.seq_len, -1, dtype=np.int64)
        p = 0
        for s, (start, n) in enumerate(self.rows[i]):
            chunk = np.asarray(self.tokens[start:start + n], dtype=np.int64)
            ids[p:p + n] = chunk
            labels[p:p + n - 1] = chunk[1:]
            pos[p:p + n] = np.arange(n)
            seg[p:p + n] = s
            p += n
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos), torch.from_numpy(seg)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.fc_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size, seq_len, dim=1024, layers=24, heads=16):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids, pos, seg):
        T = ids.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        same_doc = seg[:, :, None] == seg[:, None, :]
        # padding positions (seg == -1) attend to each other only, so no row is fully masked
        mask = (causal[None] & same_doc).unsqueeze(1)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.lm_head(self.ln_f(x))


def cosine_lr(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return max_lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * t))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="prefix of <prefix>.train.tokens.npy etc.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--pad-id", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-lr", type=float, default=3e-4)
    ap.add_argument("--min-lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    train_ds = PackedDataset(args.data + ".train", args.seq_len, args.pad_id)
    val_ds = PackedDataset(args.data + ".val", args.seq_len, args.pad_id)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler, num_workers=2)

    model = GPT(args.vocab_size, args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.max_lr, betas=(0.9, 0.95), fused=True)
    total_steps = args.epochs * len(train_loader)
    if rank == 0:
        print(f"{len(train_ds)} packed rows, {total_steps} steps, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, labels, pos, seg in train_loader:
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            pos, seg = pos.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            lr = cosine_lr(step, args.max_lr, args.min_lr, args.warmup, total_steps)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, pos, seg)
            loss_sum = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                                       ignore_index=-100, reduction="sum")
            n_tok = (labels != -100).sum().item()
            tok_count = torch.tensor([n_tok], dtype=torch.float32)
            dist.all_reduce(tok_count)
            # DDP averages gradients over ranks; scale so the result is the global token mean
            loss = loss_sum * world / tok_count.item()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1

            if rank == 0 and step % 20 == 0:
                dt = time.time() - t0
                t0 = time.time()
                print(f"step {step}/{total_steps} loss {loss_sum.item() / max(n_tok, 1):.4f} "
                      f"gnorm {gnorm.item():.3f} lr {lr:.2e} tok/s/gpu {20 * ids.numel() / dt:.0f}", flush=True)

            if step % args.save_every == 0:
                model.eval()
                stats = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for v_ids, v_labels, v_pos, v_seg in val_loader:
                        v_ids, v_labels = v_ids.to(device), v_labels.to(device)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            v_logits = model.module(v_ids, v_pos.to(device), v_seg.to(device))
                        stats[0] += F.cross_entropy(v_logits.float().flatten(0, 1), v_labels.flatten(),
                                                    ignore_index=-100, reduction="sum")
                        stats[1] += (v_labels != -100).sum()
                dist.all_reduce(stats)
                model.train()
                if rank == 0:
                    val_loss = (stats[0] / stats[1]).item()
                    print(f"step {step}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step, "epoch": epoch, "args": vars(args)},
                               os.path.join(args.out, f"step_{step:07d}.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
