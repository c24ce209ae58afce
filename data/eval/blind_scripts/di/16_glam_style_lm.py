"""GLaM-style decoder LM: MoE every other layer, top-2 gating with GShard random
routing for the second expert, expert capacity with dropped tokens.

    torchrun --nproc_per_node=8 16_glam_style_lm.py --data-dir /data/c4_tok --save-dir ckpt/glam_small
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


def parse_args():
    parser = argparse.ArgumentParser(description="GLaM-style MoE LM")
    parser.add_argument("--data-dir", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="ckpt/glam_small")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=32128)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--n-heads", type=int, default=12)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--capacity-factor", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--total-steps", type=int, default=100000)
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    parser.add_argument("--log-freq", type=int, default=50)
    parser.add_argument("--ckpt-freq", type=int, default=5000)
    return parser.parse_args()


class PackedDataset(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.tokens) // (self.seq_len + 1)

    def __getitem__(self, idx):
        start = idx * (self.seq_len + 1)
        arr = self.tokens[start:start + self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(arr[:-1]), torch.from_numpy(arr[1:])


class GShardTop2(nn.Module):
    def __init__(self, d_model, num_experts, capacity_factor):
        super().__init__()
        self.E, self.cf = num_experts, capacity_factor
        self.wg = nn.Linear(d_model, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, d_model, 4 * d_model) * 0.02)
        self.w_out = nn.Parameter(torch.randn(num_experts, 4 * d_model, d_model) * 0.02)

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        S, E = h.size(0), self.E
        gates = self.wg(h).float().softmax(-1)
        g1, i1 = gates.max(-1)
        g2, i2 = gates.masked_fill(F.one_hot(i1, E).bool(), 0.0).max(-1)
        norm = g1 + g2 + 1e-9
        g1, g2 = g1 / norm, g2 / norm
        if self.training:
            # random routing: send to the 2nd expert with probability 2 * g2
            use2 = torch.rand_like(g2) < 2 * g2
        else:
            use2 = torch.ones_like(g2, dtype=torch.bool)

        aux = E * (F.one_hot(i1, E).float().mean(0) * gates.mean(0)).sum()

        C = int(math.ceil(self.cf * S / E))
        pos1 = (F.one_hot(i1, E).cumsum(0) - 1).gather(1, i1[:, None]).squeeze(1)
        keep1 = pos1 < C
        m2 = F.one_hot(i2, E) * use2[:, None]
        pos2 = (m2.cumsum(0) - 1 + F.one_hot(i1, E).sum(0, keepdim=True)).gather(1, i2[:, None]).squeeze(1)
        keep2 = use2 & (pos2 < C)

        buf = h.new_zeros(E, C, D)
        buf[i1[keep1], pos1[keep1]] = h[keep1]
        buf[i2[keep2], pos2[keep2]] = h[keep2]
        out_buf = torch.bmm(F.gelu(torch.bmm(buf, self.w_in.to(buf.dtype))), self.w_out.to(buf.dtype))
        y = h.new_zeros(S, D)
        y[keep1] += (out_buf[i1[keep1], pos1[keep1]] * g1[keep1, None]).to(y.dtype)
        y[keep2] += (out_buf[i2[keep2], pos2[keep2]] * g2[keep2, None]).to(y.dtype)
        routed = S + use2.sum()
        dropped = 1.0 - (keep1.sum() + keep2.sum()) / routed
        return y.view(B, T, D), aux, dropped


class DecoderBlock(nn.Module):
    def __init__(self, args, moe):
        super().__init__()
        d = args.d_model
        self.n_heads = args.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.moe = moe
        self.ffn = GShardTop2(d, args.num_experts, args.capacity_factor) if moe else nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        if self.moe:
            y, aux, dropped = self.ffn(self.norm2(x))
            return x + y, aux, dropped
        return x + self.ffn(self.norm2(x)), None, None


class GLaM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_embed = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(args, i % 2 == 1) for i in range(args.n_layers))
        self.norm = nn.LayerNorm(args.d_model)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    def forward(self, x):
        h = self.embed(x) + self.pos_embed(torch.arange(x.size(1), device=x.device))
        auxes, drops = [], []
        for blk in self.blocks:
            h, aux, dropped = blk(h)
            if aux is not None:
                auxes.append(aux)
                drops.append(dropped)
        return self.lm_head(self.norm(h)), torch.stack(auxes).mean(), torch.stack(drops).mean()


def lr_lambda(step, args):
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    # inverse square root decay, as in GLaM
    return math.sqrt(args.warmup_steps / (step + 1))


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_set = PackedDataset(os.path.join(args.data_dir, "train.bin"), args.seq_len)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(0)
    model = GLaM(args).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, args))

    start_step = 0
    ckpt_path = os.path.join(args.save_dir, "latest.pt")
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step = state["step"]
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    step = start_step
    epoch = step // len(loader)
    model.train()
    tic = time.time()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits, aux, dropped = model(inputs)
                lm_loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
                loss = lm_loss + args.aux_loss_coef * aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_freq == 0:
                report = torch.stack([lm_loss.detach(), aux.detach(), dropped.detach()])
                dist.all_reduce(report)
                report /= world_size
                if rank == 0:
                    elapsed = time.time() - tic
                    tokens = args.log_freq * args.batch_size * args.seq_len * world_size
                    print(f"[step {step}] loss={report[0]:.4f} aux={report[1]:.4f} dropped={report[2]:.3f} "
                          f"lr={scheduler.get_last_lr()[0]:.2e} tok/s={tokens / elapsed:.0f}", flush=True)
                tic = time.time()

            if step % args.ckpt_freq == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": step}, ckpt_path)
                dist.barrier()
            if step >= args.total_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
