"""Switch Transformer pretraining with expert parallelism inside each node and
data parallelism across nodes.

  ep_group         : the 8 GPUs of one node; each holds num_experts / 8 experts
  expert_dp_group  : GPUs with the same local rank on different nodes; they hold
                     replicas of the same experts and average expert gradients
  dense parameters : replicated everywhere, averaged by DDP (expert params are
                     excluded from DDP)

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=node0:29400 06_switch_transformer_ep.py --data /mnt/shared/c4_tok
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data", default=None)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--ckpt", default="/mnt/shared/ckpt/switch_base")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=3072)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--eval-capacity-factor", type=float, default=2.0)
    p.add_argument("--router-z-coef", type=float, default=1e-3)
    p.add_argument("--aux-coef", type=float, default=1e-2)
    p.add_argument("--vocab", type=int, default=32128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class Shards(Dataset):
    def __init__(self, path, seq_len):
        self.tok = np.load(os.path.join(path, "tokens.npy"), mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return len(self.tok) // (self.seq_len + 1)

    def __getitem__(self, i):
        n = self.seq_len + 1
        return torch.from_numpy(np.asarray(self.tok[i * n:(i + 1) * n], dtype=np.int64))


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.saved = (out_splits, in_splits, group)
        out = x.new_empty(sum(out_splits), x.size(1))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.saved
        return AllToAll.apply(grad, in_splits, out_splits, group), None, None, None


class SwitchFFN(nn.Module):
    def __init__(self, a, ep_group):
        super().__init__()
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.E = a.num_experts
        self.local_E = a.num_experts // self.ep
        self.cf, self.eval_cf = a.capacity_factor, a.eval_capacity_factor
        self.router = nn.Linear(a.d_model, self.E, bias=False)
        self.w_in = nn.Parameter(torch.empty(self.local_E, a.d_model, a.d_ff))
        self.w_out = nn.Parameter(torch.empty(self.local_E, a.d_ff, a.d_model))
        self.aux_loss = self.z_loss = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        self.z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        probs = logits.softmax(-1)
        gate, eidx = probs.max(-1)
        self.aux_loss = self.E * (F.one_hot(eidx, self.E).float().mean(0) * probs.mean(0)).sum()

        cf = self.cf if self.training else self.eval_cf
        cap = math.ceil(cf * x.size(0) / self.E)
        oh = F.one_hot(eidx, self.E)
        pos = ((oh.cumsum(0) - 1) * oh).sum(-1)
        keep = (pos < cap).nonzero(as_tuple=True)[0]
        keep = keep[torch.argsort(eidx[keep], stable=True)]

        send_counts = torch.bincount(eidx[keep], minlength=self.E)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send_counts, recv_counts = send_counts.view(self.ep, self.local_E), recv_counts.view(self.ep, self.local_E)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()

        recv = AllToAll.apply(x[keep], out_splits, in_splits, self.ep_group)
        # [src][local expert] -> [local expert][src]
        flat_counts = recv_counts.flatten().tolist()
        pieces = recv.split(flat_counts)
        per_expert = recv_counts.sum(0).tolist()
        grouped = torch.cat([pieces[s * self.local_E + e] for e in range(self.local_E) for s in range(self.ep)])
        outs = []
        for e, h in enumerate(grouped.split(per_expert)):
            outs.append(F.gelu(h @ self.w_in[e].to(h.dtype)) @ self.w_out[e].to(h.dtype))
        out_pieces = [None] * len(pieces)
        for e, o in enumerate(outs):
            for s, chunk in enumerate(o.split(recv_counts[:, e].tolist())):
                out_pieces[s * self.local_E + e] = chunk
        back = AllToAll.apply(torch.cat(out_pieces), in_splits, out_splits, self.ep_group)

        y = torch.zeros_like(x)
        y[keep] = (back * gate[keep, None]).to(y.dtype)
        return y.view(shape)


class Layer(nn.Module):
    def __init__(self, a, ep_group, moe):
        super().__init__()
        self.h = a.n_heads
        self.n1, self.n2 = nn.LayerNorm(a.d_model), nn.LayerNorm(a.d_model)
        self.qkv = nn.Linear(a.d_model, 3 * a.d_model, bias=False)
        self.o = nn.Linear(a.d_model, a.d_model, bias=False)
        self.ffn = SwitchFFN(a, ep_group) if moe else nn.Sequential(
            nn.Linear(a.d_model, a.d_ff), nn.GELU(), nn.Linear(a.d_ff, a.d_model))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(self.n1(x)).chunk(3, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.ffn(self.n2(x))


class SwitchLM(nn.Module):
    def __init__(self, a, ep_group):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d_model)
        self.pos = nn.Parameter(torch.randn(a.seq_len, a.d_model) * 0.01)
        self.layers = nn.ModuleList([Layer(a, ep_group, moe=(i % 2 == 1)) for i in range(a.n_layers)])
        self.norm = nn.LayerNorm(a.d_model)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.size(1)]
        for l in self.layers:
            x = l(x)
        return self.norm(x) @ self.emb.weight.t()


def expert_params(model):
    return [(n, p) for n, p in model.named_parameters() if n.endswith(".w_in") or n.endswith(".w_out")]


@torch.no_grad()
def evaluate(ddp, loader, device, max_batches=100):
    ddp.eval()
    tot = torch.zeros(2, device=device)
    for i, ids in enumerate(loader):
        if i == max_batches:
            break
        ids = ids.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ddp(ids[:, :-1])
        tot[0] += F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        tot[1] += ids[:, 1:].numel()
    dist.all_reduce(tot)
    ddp.train()
    return (tot[0] / tot[1]).item()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    n_nodes = world // local_world
    device = torch.device("cuda", local_rank)

    ep_group = expert_dp_group = None
    for n in range(n_nodes):
        g = dist.new_group(list(range(n * local_world, (n + 1) * local_world)))
        if rank // local_world == n:
            ep_group = g
    for l in range(local_world):
        g = dist.new_group(list(range(l, world, local_world)))
        if rank % local_world == l:
            expert_dp_group = g
    ep_rank = dist.get_rank(ep_group)

    torch.manual_seed(a.seed)
    model = SwitchLM(a, ep_group)
    # replicas of the same experts (same ep_rank on every node) start identical
    gen = torch.Generator().manual_seed(a.seed + 1 + ep_rank)
    for _, p in expert_params(model):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.to(device)

    exp_names = [n for n, _ in expert_params(model)]
    DDP._set_params_and_buffers_to_ignore_for_model(model, exp_names)
    ddp = DDP(model, device_ids=[local_rank])
    exp_p = [p for _, p in expert_params(model)]
    dense_p = [p for n, p in model.named_parameters() if n not in set(exp_names)]

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup) / math.sqrt(max(s, a.warmup) / a.warmup))

    start = 0
    os.makedirs(a.ckpt, exist_ok=True)
    if a.resume and os.path.exists(os.path.join(a.ckpt, "dense.pt")):
        dense = torch.load(os.path.join(a.ckpt, "dense.pt"), map_location="cpu")
        assert dense["ep_size"] == dist.get_world_size(ep_group), "expert layout changed since this checkpoint"
        experts = torch.load(os.path.join(a.ckpt, f"experts_ep{ep_rank:02d}.pt"), map_location="cpu")
        model.load_state_dict({**dense["model"], **experts["model"]})
        opt.load_state_dict(experts["opt"])
        sched.load_state_dict(dense["sched"])
        start = dense["step"]

    ds = Shards(a.data, a.seq_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=a.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    val_loader = None
    if a.val_data:
        val_ds = Shards(a.val_data, a.seq_len)
        val_loader = DataLoader(val_ds, batch_size=a.batch, num_workers=2, drop_last=True,
                                sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    step, epoch = start, start // max(1, len(loader))
    t0 = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for ids in loader:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(ids[:, :-1])
            ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            moe = [m for m in model.modules() if isinstance(m, SwitchFFN)]
            aux = sum(m.aux_loss for m in moe) / len(moe)
            z = sum(m.z_loss for m in moe) / len(moe)
            loss = ce + a.aux_coef * aux + a.router_z_coef * z

            opt.zero_grad(set_to_none=True)
            loss.backward()
            # expert grads: sum over replicas, then mean over all ranks' losses
            for p in exp_p:
                dist.all_reduce(p.grad, group=expert_dp_group)
                p.grad.div_(world)
            dense_sq = sum(p.grad.float().pow(2).sum() for p in dense_p if p.grad is not None)
            exp_sq = sum(p.grad.float().pow(2).sum() for p in exp_p)
            dist.all_reduce(exp_sq, group=ep_group)
            gnorm = (dense_sq + exp_sq).sqrt()
            scale = torch.clamp(a.clip / (gnorm + 1e-6), max=1.0)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                stats = torch.stack([ce.detach(), aux.detach()])
                dist.all_reduce(stats)
                stats /= world
                if rank == 0:
                    print(f"step {step} ce {stats[0]:.4f} aux {stats[1]:.4f} gnorm {gnorm.item():.3f} "
                          f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
                    t0 = time.time()
            if val_loader is not None and step % a.eval_every == 0:
                vl = evaluate(ddp, val_loader, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % a.save_every == 0 or step == a.steps:
                if dist.get_rank(expert_dp_group) == 0:
                    torch.save({"model": {n: p.detach().cpu() for n, p in expert_params(model)},
                                "opt": opt.state_dict()}, os.path.join(a.ckpt, f"experts_ep{ep_rank:02d}.pt"))
                if rank == 0:
                    dense_sd = {k: v.cpu() for k, v in model.state_dict().items() if k not in set(exp_names)}
                    torch.save({"model": dense_sd, "sched": sched.state_dict(), "step": step,
                                "ep_size": dist.get_world_size(ep_group)}, os.path.join(a.ckpt, "dense.pt"))
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
