"""Supervised fine-tuning of a tensor-parallel decoder on chat data.

Tensor parallel inside a group of --tp GPUs, data parallel over the groups.
Loss is only taken on assistant tokens (loss_mask == 1).

    torchrun --standalone --nproc_per_node=8 08_tp_sft_chat.py --tp 4 \
        --init ckpt/base_tp4 --data data/sft_tokenized.jsonl
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

G = {}


def init_distributed(tp_size):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    tp_rank = rank % tp_size
    # one GPU per tensor-parallel rank
    torch.cuda.set_device(tp_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for i in range(world // tp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        grp = dist.new_group(ranks)
        if rank in ranks:
            G["tp"] = grp
    for j in range(tp_size):
        ranks = list(range(j, world, tp_size))
        grp = dist.new_group(ranks)
        if rank in ranks:
            G["dp"] = grp
    G.update(rank=rank, tp_rank=tp_rank, tp_size=tp_size, dp_rank=rank // tp_size, dp_size=world // tp_size)


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=G["tp"])
        return g


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=G["tp"])
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class ColPar(nn.Module):
    def __init__(self, fin, fout, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fout // G["tp_size"], fin))
        self.bias = nn.Parameter(torch.zeros(fout // G["tp_size"])) if bias else None

    def forward(self, x):
        return F.linear(CopyToTP.apply(x), self.weight, self.bias)


class RowPar(nn.Module):
    def __init__(self, fin, fout):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fout, fin // G["tp_size"]))

    def forward(self, x):
        return ReduceFromTP.apply(F.linear(x, self.weight))


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, d, n_heads, ffn):
        super().__init__()
        self.nh, self.hd = n_heads // G["tp_size"], d // n_heads
        self.in_norm, self.post_norm = RMSNorm(d), RMSNorm(d)
        self.qkv = ColPar(d, 3 * d)
        self.o = RowPar(d, d)
        self.gate_up = ColPar(d, 2 * ffn)
        self.down = RowPar(ffn, d)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.in_norm(x)).view(B, T, 3, self.nh, self.hd).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TPDecoder(nn.Module):
    def __init__(self, vocab, d, n_heads, n_layers, ffn, max_len):
        super().__init__()
        self.vocab_per = vocab // G["tp_size"]
        self.vstart = G["tp_rank"] * self.vocab_per
        self.embed = nn.Parameter(torch.empty(self.vocab_per, d))
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(DecoderLayer(d, n_heads, ffn) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.lm_head = ColPar(d, vocab)

    def forward(self, ids):
        off = ids - self.vstart
        mask = (off < 0) | (off >= self.vocab_per)
        h = F.embedding(off.masked_fill(mask, 0), self.embed).masked_fill(mask[..., None], 0.0)
        h = ReduceFromTP.apply(h) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            h = layer(h)
        local_logits = self.lm_head(self.norm(h))
        # gather the vocab shards; SFT sequences are short so the full logits fit
        parts = [torch.empty_like(local_logits) for _ in range(G["tp_size"])]
        dist.all_gather(parts, local_logits.contiguous(), group=G["tp"])
        parts[G["tp_rank"]] = local_logits
        return torch.cat(parts, dim=-1)


class SFTJsonl(Dataset):
    def __init__(self, path, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids = r["input_ids"][: self.max_len + 1]
        lm = r["loss_mask"][: self.max_len + 1]
        pad = self.max_len + 1 - len(ids)
        ids, lm = ids + [0] * pad, lm + [0] * pad
        ids, lm = torch.tensor(ids), torch.tensor(lm, dtype=torch.float)
        return ids[:-1], ids[1:], lm[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--init", required=True, help="directory with tp_XX.pt shards of the base model")
    ap.add_argument("--out", default="ckpt/sft")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    init_distributed(args.tp)
    torch.manual_seed(0)
    model = TPDecoder(args.vocab, args.d, args.heads, args.layers, args.ffn, args.max_len)
    shard = torch.load(os.path.join(args.init, f"tp_{G['tp_rank']:02d}.pt"), map_location="cpu")
    model.load_state_dict(shard)
    model = model.to(torch.bfloat16).cuda()
    ddp = DDP(model, device_ids=[torch.cuda.current_device()], process_group=G["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    ds = SFTJsonl(args.data, args.max_len)
    sampler = DistributedSampler(ds, num_replicas=G["dp_size"], rank=G["dp_rank"], shuffle=True, seed=7)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, drop_last=True)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y, lm in dl:
            x, y, lm = x.cuda(), y.cuda(), lm.cuda()
            logits = ddp(x)
            tok_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            loss = (tok_loss * lm.flatten()).sum() / lm.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0:
                stat = torch.stack([loss.detach(), lm.sum()])
                dist.all_reduce(stat, group=G["dp"])
                if G["rank"] == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {stat[0].item() / G['dp_size']:.4f} "
                          f"tokens {int(stat[1].item())}", flush=True)

        if G["dp_rank"] == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, f"epoch{epoch}_tp_{G['tp_rank']:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
