"""MoE LM, expert parallel over all GPUs with GShard-style fixed-capacity dispatch.

Every rank packs its tokens into a [experts, capacity, d] buffer, an all_to_all
moves each expert's slots to the GPU that owns it, and a second all_to_all brings
the results back. Slots are fixed size, so the splits are equal.

    torchrun --nproc_per_node=8 14_moe_lm_expert_parallel_v2.py --data /data/tinystories_tok --out /ckpt/ts_moe
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--d", type=int, default=768)
p.add_argument("--layers", type=int, default=12)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--experts-per-gpu", type=int, default=2)
p.add_argument("--cf", type=float, default=1.5)
p.add_argument("--bs", type=int, default=32)
p.add_argument("--lr", type=float, default=5e-4)
p.add_argument("--warmup", type=int, default=1000)
p.add_argument("--steps", type=int, default=30000)
p.add_argument("--aux", type=float, default=0.01)
p.add_argument("--z", type=float, default=1e-3)
p.add_argument("--save-every", type=int, default=1000)
p.add_argument("--wandb", action="store_true")


class Stories(Dataset):
    def __init__(self, path, seq):
        self.arr = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq

    def __len__(self):
        return (len(self.arr) - 1) // self.seq

    def __getitem__(self, i):
        c = torch.from_numpy(self.arr[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return c[:-1], c[1:]


class EPMoE(nn.Module):
    def __init__(self, d, local_experts):
        super().__init__()
        self.world = dist.get_world_size()
        self.L = local_experts
        self.E = local_experts * self.world
        self.gate = nn.Linear(d, self.E, bias=False)
        self.wi = nn.Parameter(torch.empty(self.L, d, 4 * d))
        self.wo = nn.Parameter(torch.empty(self.L, 4 * d, d))
        self.cf = 1.0

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        S = h.size(0)
        logits = self.gate(h).float()
        probs = logits.softmax(-1)
        g, e = probs.max(-1)                                   # top-1
        C = int(math.ceil(self.cf * S / self.E))
        slot = (F.one_hot(e, self.E).cumsum(0) - 1).gather(1, e[:, None]).squeeze(1)
        keep = slot < C
        aux = self.E * (F.one_hot(e, self.E).float().mean(0) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()

        buf = h.new_zeros(self.E * C, D)
        flat_slot = e * C + slot
        buf = buf.index_copy(0, flat_slot[keep], h[keep])
        # [E*C, D] ordered by global expert = [world][local][C]; equal splits per destination
        recv = dfn.all_to_all_single(torch.empty_like(buf), buf)
        recv = recv.view(self.world, self.L, C, D).transpose(0, 1).reshape(self.L, self.world * C, D)
        hid = F.gelu(torch.bmm(recv, self.wi.to(recv.dtype)))
        res = torch.bmm(hid, self.wo.to(hid.dtype))
        res = res.view(self.L, self.world, C, D).transpose(0, 1).reshape(self.E * C, D)
        back = dfn.all_to_all_single(torch.empty_like(res), res)
        out = h.new_zeros(S, D)
        out[keep] = (back[flat_slot[keep]] * g[keep, None]).to(out.dtype)
        return out.view(B, T, D), aux, z, 1.0 - keep.float().mean()


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h = a.heads
        self.ln1, self.ln2 = nn.LayerNorm(a.d), nn.LayerNorm(a.d)
        self.attn_in = nn.Linear(a.d, 3 * a.d)
        self.attn_out = nn.Linear(a.d, a.d)
        self.moe = moe
        if moe:
            self.ff = EPMoE(a.d, a.experts_per_gpu)
            self.ff.cf = a.cf
        else:
            self.ff = nn.Sequential(nn.Linear(a.d, 4 * a.d), nn.GELU(), nn.Linear(4 * a.d, a.d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn_in(self.ln1(x)).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + self.attn_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        if self.moe:
            y, aux, z, dr = self.ff(self.ln2(x))
            return x + y, (aux, z, dr)
        return x + self.ff(self.ln2(x)), None


class Net(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.d)
        self.pos = nn.Embedding(a.seq, a.d)
        self.blocks = nn.ModuleList(Block(a, i % 2 == 1) for i in range(a.layers))
        self.ln = nn.LayerNorm(a.d)
        self.head = nn.Linear(a.d, a.vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        extras = []
        for b in self.blocks:
            x, ex = b(x)
            if ex is not None:
                extras.append(ex)
        aux, z, dr = (torch.stack(v).mean() for v in zip(*extras))
        return self.head(self.ln(x)), aux, z, dr


def expert_param(name):
    return name.endswith("ff.wi") or name.endswith("ff.wo")


def main():
    a = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    torch.manual_seed(0)
    net = Net(a)
    g = torch.Generator().manual_seed(100 + rank)  # distinct experts per rank
    for n, prm in net.named_parameters():
        if expert_param(n):
            with torch.no_grad():
                prm.normal_(0, 0.02, generator=g)
    net.to(dev)
    dense_params = [prm for n, prm in net.named_parameters() if not expert_param(n)]
    expert_params = [prm for n, prm in net.named_parameters() if expert_param(n)]
    opt = torch.optim.AdamW([{"params": dense_params}, {"params": expert_params}], lr=a.lr,
                            betas=(0.9, 0.95), weight_decay=0.1)

    ds = Stories(os.path.join(a.data, "train.bin"), a.seq)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=a.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    ckpt_path = os.path.join(a.out, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step = ck["step"]
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        if a.wandb:
            wandb.init(project="tinystories-moe", config=vars(a))
    dist.barrier()

    epoch = step // len(dl)
    t = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in dl:
            lr = a.lr * min(1.0, (step + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * min(step / a.steps, 1.0)))
            for pg in opt.param_groups:
                pg["lr"] = lr
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z, dr = net(x)
                ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = ce + a.aux * aux + a.z * z
            opt.zero_grad(set_to_none=True)
            loss.backward()

            flat = torch._utils._flatten_dense_tensors([q.grad for q in dense_params])
            dist.all_reduce(flat)
            flat /= world
            for q, s in zip(dense_params, torch._utils._unflatten_dense_tensors(flat, [q.grad for q in dense_params])):
                q.grad.copy_(s)
            for q in expert_params:
                q.grad /= world  # summed over every rank's tokens by the backward all_to_all
            opt.step()
            step += 1

            if step % 25 == 0:
                m = torch.stack([ce.detach(), aux.detach(), dr.detach()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} ce {m[0]:.4f} aux {m[1]:.4f} dropped {m[2]:.2%} lr {lr:.2e} "
                          f"{(time.time() - t) / 25:.3f}s/it", flush=True)
                    if a.wandb:
                        wandb.log({"ce": m[0].item(), "aux": m[1].item(), "dropped": m[2].item(), "lr": lr}, step=step)
                t = time.time()

            if step % a.save_every == 0:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt_path)
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    if rank == 0 and a.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
