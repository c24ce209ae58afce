"""Small Evoformer trunk + distogram head (AlphaFold2-style), trained on PDB crops with MSAs.

Features per chain (npz): msa int8 (N, L), cb float32 (L, 3), cb_mask (L,), optional template_dgram (L, L, 39).
Templates are dropped for a fraction of the samples, so the template embedder is not used every step.

    torchrun --nproc_per_node=8 18_evoformer_distogram.py --feat-dir data/pdb_feats --list data/train_chains.txt
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_AA = 23  # 20 aa + X + gap + mask
N_BINS = 64


class ChainFeatures(Dataset):
    def __init__(self, feat_dir, list_file, crop=192, max_msa=128, p_template=0.75, train=True):
        with open(list_file) as f:
            self.ids = [l.split()[0] for l in f if l.strip()]
        self.dir, self.crop, self.max_msa = feat_dir, crop, max_msa
        self.p_template, self.train = p_template, train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.dir, self.ids[i] + ".npz"))
        msa, cb, mask = d["msa"].astype(np.int64), d["cb"], d["cb_mask"].astype(np.float32)
        L = msa.shape[1]
        rng = np.random.default_rng() if self.train else np.random.default_rng(i)
        s = rng.integers(0, max(1, L - self.crop + 1))
        sl = slice(s, s + self.crop)
        keep = np.concatenate([[0], 1 + rng.permutation(msa.shape[0] - 1)[: self.max_msa - 1]])
        out = {"msa": torch.from_numpy(msa[keep][:, sl]), "cb": torch.from_numpy(cb[sl]),
               "mask": torch.from_numpy(mask[sl])}
        if "template_dgram" in d and (not self.train or rng.random() < self.p_template):
            out["template"] = torch.from_numpy(d["template_dgram"][sl, sl]).float()
        return out


def collate_single(batch):
    assert len(batch) == 1
    return {k: v.unsqueeze(0) for k, v in batch[0].items()}


class RowAttnPairBias(nn.Module):
    def __init__(self, cm, cz, h=8):
        super().__init__()
        self.h, self.ln, self.lnz = h, nn.LayerNorm(cm), nn.LayerNorm(cz)
        self.qkv = nn.Linear(cm, 3 * cm, bias=False)
        self.bias = nn.Linear(cz, h, bias=False)
        self.gate, self.o = nn.Linear(cm, cm), nn.Linear(cm, cm)

    def forward(self, m, z):
        B, N, L, C = m.shape
        x = self.ln(m)
        q, k, v = self.qkv(x).view(B, N, L, 3, self.h, C // self.h).unbind(3)
        b = self.bias(self.lnz(z)).permute(0, 3, 1, 2).unsqueeze(1)           # B,1,h,L,L
        a = torch.einsum("bnihc,bnjhc->bnhij", q, k) / (C // self.h) ** 0.5 + b
        o = torch.einsum("bnhij,bnjhc->bnihc", a.softmax(-1), v).reshape(B, N, L, C)
        return m + self.o(torch.sigmoid(self.gate(x)) * o)


class ColAttn(nn.Module):
    def __init__(self, cm, h=8):
        super().__init__()
        self.ln = nn.LayerNorm(cm)
        self.attn = nn.MultiheadAttention(cm, h, batch_first=True)

    def forward(self, m):
        B, N, L, C = m.shape
        x = self.ln(m).permute(0, 2, 1, 3).reshape(B * L, N, C)
        o = self.attn(x, x, x, need_weights=False)[0].view(B, L, N, C).permute(0, 2, 1, 3)
        return m + o


class OuterProductMean(nn.Module):
    def __init__(self, cm, cz, c=32):
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(cm), nn.Linear(cm, c), nn.Linear(cm, c)
        self.o = nn.Linear(c * c, cz)

    def forward(self, m, z):
        x = self.ln(m)
        op = torch.einsum("bnic,bnjd->bijcd", self.a(x), self.b(x)) / m.shape[1]
        return z + self.o(op.flatten(-2))


class TriMul(nn.Module):
    def __init__(self, cz, c=128, outgoing=True):
        super().__init__()
        self.outgoing = outgoing
        self.ln, self.ln_o = nn.LayerNorm(cz), nn.LayerNorm(c)
        self.ab, self.g_ab = nn.Linear(cz, 2 * c), nn.Linear(cz, 2 * c)
        self.g, self.o = nn.Linear(cz, cz), nn.Linear(c, cz)

    def forward(self, z):
        x = self.ln(z)
        a, b = (torch.sigmoid(self.g_ab(x)) * self.ab(x)).chunk(2, -1)
        eq = "bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc"
        return z + torch.sigmoid(self.g(x)) * self.o(self.ln_o(torch.einsum(eq, a, b)))


class EvoformerBlock(nn.Module):
    def __init__(self, cm=128, cz=64):
        super().__init__()
        self.row, self.col = RowAttnPairBias(cm, cz), ColAttn(cm)
        self.m_trans = nn.Sequential(nn.LayerNorm(cm), nn.Linear(cm, 4 * cm), nn.ReLU(), nn.Linear(4 * cm, cm))
        self.opm = OuterProductMean(cm, cz)
        self.tri_out, self.tri_in = TriMul(cz, outgoing=True), TriMul(cz, outgoing=False)
        self.z_trans = nn.Sequential(nn.LayerNorm(cz), nn.Linear(cz, 4 * cz), nn.ReLU(), nn.Linear(4 * cz, cz))

    def forward(self, m, z):
        m = self.col(self.row(m, z))
        m = m + self.m_trans(m)
        z = self.tri_in(self.tri_out(self.opm(m, z)))
        return m, z + self.z_trans(z)


class DistogramNet(nn.Module):
    def __init__(self, cm=128, cz=64, n_blocks=8, grad_ckpt=True):
        super().__init__()
        self.msa_emb = nn.Embedding(N_AA, cm)
        self.left, self.right = nn.Embedding(N_AA, cz), nn.Embedding(N_AA, cz)
        self.relpos = nn.Embedding(65, cz)
        self.template_emb = nn.Sequential(nn.Linear(39, cz), nn.ReLU(), nn.Linear(cz, cz))
        self.blocks = nn.ModuleList([EvoformerBlock(cm, cz) for _ in range(n_blocks)])
        self.head = nn.Linear(cz, N_BINS)
        self.grad_ckpt = grad_ckpt

    def forward(self, msa, template=None):
        L = msa.shape[-1]
        seq = msa[:, 0]
        m = self.msa_emb(msa)
        idx = torch.arange(L, device=msa.device)
        z = self.left(seq)[:, :, None] + self.right(seq)[:, None, :]
        z = z + self.relpos((idx[None, :] - idx[:, None]).clamp(-32, 32) + 32)
        if template is not None:
            z = z + self.template_emb(template)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                m, z = checkpoint(blk, m, z, use_reentrant=True)
            else:
                m, z = blk(m, z)
        z = 0.5 * (z + z.transpose(1, 2))
        return self.head(z)


def distogram_loss(logits, cb, mask):
    d = torch.cdist(cb, cb)
    bins = torch.linspace(2.3125, 21.6875, N_BINS - 1, device=cb.device)
    target = torch.bucketize(d, bins)
    pair_mask = mask[:, :, None] * mask[:, None, :]
    ce = F.cross_entropy(logits.permute(0, 3, 1, 2), target, reduction="none")
    return (ce * pair_mask).sum() / pair_mask.sum().clamp(min=1), target, pair_mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--feat-dir", required=True)
    ap.add_argument("--list", required=True)
    ap.add_argument("--val-list", default="data/val_chains.txt")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--val-every", type=int, default=2000)
    ap.add_argument("--out", default="ckpt/evo_dgram")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = ChainFeatures(args.feat_dir, args.list)
    val_ds = ChainFeatures(args.feat_dir, args.val_list, crop=384, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    dl = DataLoader(train_ds, batch_size=1, sampler=sampler, collate_fn=collate_single, num_workers=6,
                    pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1,
                        collate_fn=collate_single, num_workers=2)

    net = DistogramNet().to(device)
    # the template embedder only runs for samples that keep their templates
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * (0.95 ** (s // 5000)))

    os.makedirs(args.out, exist_ok=True)
    ck_path = os.path.join(args.out, "last.pt")
    step, epoch = 0, 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, epoch = ck["step"], ck["epoch"]

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch["msa"], batch.get("template"))
            loss, _, _ = distogram_loss(logits.float(), batch["cb"], batch["mask"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} ({(time.time() - t0) / 50:.2f}s/step)", flush=True)
                t0 = time.time()

            if step % args.val_every == 0:
                net.eval()
                acc = torch.zeros(3, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vb in val_dl:
                        vb = {k: v.to(device) for k, v in vb.items()}
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            lg = net(vb["msa"], vb.get("template")).float()
                        vl, tgt, pm = distogram_loss(lg, vb["cb"], vb["mask"])
                        # precision of predicted contacts (< 8A) among pairs with |i-j| >= 24
                        L = tgt.shape[-1]
                        sep = (torch.arange(L, device=device)[None] - torch.arange(L, device=device)[:, None]).abs() >= 24
                        p_contact = lg.softmax(-1)[..., :19].sum(-1)
                        valid = (pm > 0) & sep
                        k = min(L // 5, int(valid.sum().item()))
                        if k > 0:
                            top = p_contact[valid].topk(k).indices
                            acc[0] += (tgt[valid][top] < 19).float().mean()
                        acc[1] += vl
                        acc[2] += 1
                dist.all_reduce(acc)
                net.train()
                if rank == 0:
                    print(f"[val] step {step} loss {(acc[1] / acc[2]).item():.4f} "
                          f"P@L/5 long-range {(acc[0] / acc[2]).item():.3f}", flush=True)
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "step": step, "epoch": epoch}, ck_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
