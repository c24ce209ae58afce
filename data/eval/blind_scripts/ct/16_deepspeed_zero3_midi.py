"""Large relative-attention Music Transformer on REMI tokens (MetaMIDI subset) with DeepSpeed ZeRO-3.

deepspeed --num_gpus 8 16_deepspeed_zero3_midi.py --data data/metamidi_remi --out runs/mmd_zero3
"""
import argparse
import math
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/mmd_zero3")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--d_model", type=int, default=1536)
    ap.add_argument("--n_layers", type=int, default=24)
    ap.add_argument("--n_heads", type=int, default=16)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--global_bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class TokenWindows(Dataset):
    """pieces.npy: concatenated int16 tokens; bounds.npy: (n_pieces, 2) start/end of each piece."""

    def __init__(self, folder, split, seq_len, pitch_range=None, transpose=0):
        self.tok = np.load(os.path.join(folder, f"{split}_tokens.npy"), mmap_mode="r")
        bounds = np.load(os.path.join(folder, f"{split}_bounds.npy"))
        self.seq_len, self.pitch_range, self.transpose = seq_len, pitch_range, transpose
        self.win = np.array([(s, e) for a, b in bounds for s, e in
                             ((st, min(st + seq_len + 1, b)) for st in range(a, max(a + 1, b - seq_len // 2), seq_len))])

    def __len__(self):
        return len(self.win)

    def __getitem__(self, i):
        s, e = self.win[i]
        w = np.array(self.tok[s:e], dtype=np.int64)
        if self.transpose:
            lo, hi = self.pitch_range
            m = (w >= lo) & (w <= hi)
            if m.any():
                t = np.random.randint(-self.transpose, self.transpose + 1)
                if w[m].min() + t >= lo and w[m].max() + t <= hi:
                    w[m] += t
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


class RelAttention(nn.Module):
    def __init__(self, d, h, max_len):
        super().__init__()
        self.h, self.dh, self.max_len = h, d // h, max_len
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.Er = nn.Parameter(torch.randn(max_len, self.dh) * 0.02)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        rel = torch.matmul(q, self.Er[self.max_len - l:].t())
        rel = F.pad(rel, (1, 0)).reshape(b, self.h, l + 1, l)[:, :, 1:]
        rel = rel / math.sqrt(self.dh)
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).triu(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=rel.masked_fill(causal, float("-inf")))
        return self.o(y.transpose(1, 2).reshape(b, l, d))


class Layer(nn.Module):
    def __init__(self, d, h, max_len):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = RelAttention(d, h, max_len)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MusicTransformer(nn.Module):
    def __init__(self, vocab, d, n_layers, h, max_len):
        super().__init__()
        self.max_len = max_len
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, h, max_len) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = REMI(params=os.path.join(args.data, "tokenizer.json"))
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    train_ds = TokenWindows(args.data, "train", args.seq_len, (pitch[0], pitch[-1]), transpose=5)
    val_ds = TokenWindows(args.data, "valid", args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_bs, sampler=val_sampler, num_workers=2)

    model = MusicTransformer(len(tok.vocab), args.d_model, args.n_layers, args.n_heads, args.seq_len)
    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    grad_accum = max(1, args.global_bs // (args.micro_bs * world))    # keep the global batch fixed
    updates = args.epochs * len(train_dl) // grad_accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": min(1000, updates // 10), "total_num_steps": updates}},
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for i, seq in enumerate(train_dl):
            seq = seq.to(device, non_blocking=True)
            logits = engine(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=0)
            engine.backward(loss)
            engine.step()
            if rank == 0 and engine.is_gradient_accumulation_boundary() and engine.global_steps % 50 == 0:
                print(f"ep {epoch} upd {engine.global_steps} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/micro", flush=True)

        # validation: every rank runs the same number of forwards (ZeRO-3 gathers parameters in forward)
        engine.eval()
        s = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for seq in val_dl:
                seq = seq.to(device)
                lg = engine(seq[:, :-1]).float()
                s[0] += F.cross_entropy(lg.transpose(1, 2), seq[:, 1:], ignore_index=0, reduction="sum")
                s[1] += (seq[:, 1:] != 0).sum()
            dist.all_reduce(s)
            # demo continuation, identical on all ranks (fixed seed, fixed length)
            g = torch.Generator(device=device).manual_seed(epoch)
            gen = torch.tensor([[tok["BOS_None"]]], device=device)
            for _ in range(512):
                lg = engine(gen[:, -args.seq_len:])[:, -1].float()
                top = lg.topk(32)
                nxt = top.indices.gather(1, torch.multinomial(top.values.softmax(-1), 1, generator=g))
                gen = torch.cat([gen, nxt], 1)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {math.exp(s[0] / s[1]):.3f}", flush=True)
            tok.decode(gen[0, 1:].tolist()).dump_midi(os.path.join(args.out, "samples", f"epoch{epoch}.mid"))
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")

    # plain state dict for the standalone generation script
    if rank == 0:
        torch.save(engine.module.state_dict(), os.path.join(args.out, "music_transformer.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
