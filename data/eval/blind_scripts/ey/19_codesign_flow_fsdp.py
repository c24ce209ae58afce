"""MultiFlow-lite: joint sequence + CA-structure flow matching, FSDP-sharded transformer.

Structure: Euclidean flow on CA coordinates (random-rotation augmented).
Sequence: masking discrete flow (tokens are progressively unmasked).

    torchrun --nproc_per_node=8 19_codesign_flow_fsdp.py --train /shared/cath/cath43_s40_train.pt \
        --val /shared/cath/cath43_s40_val.pt --save_dir /shared/ckpt/codesign_fsdp
"""
import argparse
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType, FullStateDictConfig, ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWY"
MASK_ID = len(AA)


class ChainSet(Dataset):
    def __init__(self, path, max_len=256):
        self.data = torch.load(path, map_location="cpu")  # list of {"seq": LongTensor[L], "ca": [L,3]}
        self.max_len = max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        seq, ca = self.data[i]["seq"], self.data[i]["ca"].float()
        L = min(len(seq), self.max_len)
        s = torch.randint(0, len(seq) - L + 1, (1,)).item()
        seq, ca = seq[s:s + L], ca[s:s + L]
        out_s = torch.full((self.max_len,), MASK_ID, dtype=torch.long)
        out_x = torch.zeros(self.max_len, 3)
        m = torch.zeros(self.max_len, dtype=torch.bool)
        out_s[:L], out_x[:L], m[:L] = seq, (ca - ca.mean(0)) / 10.0, True
        return out_s, out_x, m


def rand_rot(B, device):
    A = torch.randn(B, 3, 3, device=device)
    Q, R = torch.linalg.qr(A)
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]
    det = torch.linalg.det(Q)
    Q[:, :, 0] = Q[:, :, 0] * det[:, None]
    return Q


class CoBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d, elementwise_affine=False), nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.mod = nn.Linear(d, 6 * d)

    def forward(self, x, c, pad):
        s1, b1, g1, s2, b2, g2 = self.mod(c)[:, None].chunk(6, -1)
        y = self.n1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(y, y, y, key_padding_mask=pad, need_weights=False)[0]
        y = self.n2(x) * (1 + s2) + b2
        return x + g2 * self.mlp(y)


class CoDesignNet(nn.Module):
    def __init__(self, d=1024, depth=24, heads=16, max_len=256):
        super().__init__()
        self.tok = nn.Embedding(len(AA) + 1, d)
        self.xyz = nn.Linear(3, d)
        self.pos = nn.Embedding(max_len, d)
        self.t_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(CoBlock(d, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.x_head = nn.Linear(d, 3)
        self.s_head = nn.Linear(d, len(AA))

    def forward(self, seq_t, x_t, t, m):
        f = torch.exp(-math.log(10000) * torch.arange(128, device=t.device) / 128)
        temb = torch.cat([(t[:, None] * 1000 * f).sin(), (t[:, None] * 1000 * f).cos()], -1)
        c = self.t_mlp(temb.to(self.pos.weight.dtype))
        idx = torch.arange(seq_t.shape[1], device=t.device)
        h = self.tok(seq_t) + self.xyz(x_t) + self.pos(idx)[None]
        for blk in self.blocks:
            h = blk(h, c, ~m)
        h = self.norm(h)
        return self.x_head(h), self.s_head(h)


def cofm_loss(model, seq, x1, m):
    B = seq.shape[0]
    x1 = torch.einsum("bij,blj->bli", rand_rot(B, x1.device), x1) * m[..., None]
    t = torch.rand(B, device=seq.device)
    x0 = torch.randn_like(x1) * m[..., None]
    xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
    unmasked = torch.rand(seq.shape, device=seq.device) < t[:, None]
    seq_t = torch.where(unmasked & m, seq, torch.full_like(seq, MASK_ID))
    x1_hat, logits = model(seq_t, xt, t, m)
    w = m.float()
    x_loss = (((x1_hat.float() - x1) ** 2).sum(-1) * w).sum() / w.sum() / (1 - t.clamp(max=0.9)).pow(2).mean()
    smask = (~unmasked & m)
    s_loss = F.cross_entropy(logits.float()[smask], seq[smask]) if smask.any() else logits.sum() * 0.0
    return x_loss + s_loss, x_loss.detach(), s_loss.detach()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train_ds, val_ds = ChainSet(args.train), ChainSet(args.val)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, num_workers=6, pin_memory=True, drop_last=True)
    va_dl = DataLoader(val_ds, batch_size=args.bs, sampler=va_sampler, num_workers=2, drop_last=True)

    model = FSDP(CoDesignNet(),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={CoBlock}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), sync_module_states=True, use_orig_params=True,
                 limit_all_gathers=True)
    torch.manual_seed(100 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / (args.epochs * len(tr_dl))))))

    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(3, device="cuda")
        for it, (seq, x, m) in enumerate(tr_dl):
            seq, x, m = seq.cuda(non_blocking=True), x.cuda(non_blocking=True), m.cuda(non_blocking=True)
            loss, lx, ls = cofm_loss(model, seq, x, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            agg += torch.stack([lx, ls, torch.ones((), device="cuda")])
        dist.all_reduce(agg)

        model.eval()
        vagg = torch.zeros(3, device="cuda")
        with torch.no_grad():
            for seq, x, m in va_dl:
                seq, x, m = seq.cuda(), x.cuda(), m.cuda()
                _, lx, ls = cofm_loss(model, seq, x, m)
                vagg += torch.stack([lx, ls, torch.ones((), device="cuda")])
        dist.all_reduce(vagg)
        val = ((vagg[0] + vagg[1]) / vagg[2]).item()

        if rank == 0:
            print(f"epoch {epoch} | train x {agg[0] / agg[2]:.4f} seq {agg[1] / agg[2]:.4f} | "
                  f"val x {vagg[0] / vagg[2]:.4f} seq {vagg[1] / vagg[2]:.4f}", flush=True)
            if val < best:
                best = val
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                    weights = model.state_dict()
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"model": weights, "epoch": epoch, "val": val}, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
