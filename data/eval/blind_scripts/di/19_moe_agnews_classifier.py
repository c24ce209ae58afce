"""MoE transformer encoder for AG News topic classification (trained from scratch).

Top-2 routed FFN experts in every other layer, load-balancing + z-loss, DDP on
one node. Resumable; at the end the best checkpoint is reloaded and scored on
the test split.

    torchrun --nproc_per_node=8 19_moe_agnews_classifier.py --out runs/agnews_moe [--resume]
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/agnews_moe")
    ap.add_argument("--tokenizer", default="bert-base-uncased")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--cf", type=float, default=1.5)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--aux", type=float, default=0.01)
    ap.add_argument("--zloss", type=float, default=1e-3)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class Top2FFN(nn.Module):
    def __init__(self, dim, n_exp, cf):
        super().__init__()
        self.n_exp, self.cf = n_exp, cf
        self.router = nn.Linear(dim, n_exp, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))
            for _ in range(n_exp))

    def forward(self, x, keep_mask):
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        valid = keep_mask.reshape(-1)
        tok_ids = valid.nonzero(as_tuple=True)[0]           # padding tokens are not routed
        h = flat[tok_ids]
        logits = self.router(h).float()
        probs = logits.softmax(-1)
        w, e = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        n = h.size(0)
        cap = math.ceil(self.cf * 2 * n / self.n_exp)
        e_f, w_f = e.t().reshape(-1), w.t().reshape(-1)
        t_f = torch.arange(n, device=x.device).repeat(2)
        pos = (F.one_hot(e_f, self.n_exp).cumsum(0) - 1).gather(1, e_f[:, None]).squeeze(1)
        keep = pos < cap
        e_f, w_f, t_f = e_f[keep], w_f[keep], t_f[keep]
        order = e_f.argsort(stable=True)
        e_f, w_f, t_f = e_f[order], w_f[order], t_f[order]
        sizes = torch.bincount(e_f, minlength=self.n_exp).tolist()
        outs = torch.cat([ex(c) for ex, c in zip(self.experts, h[t_f].split(sizes))])
        y_tok = torch.zeros_like(h).index_add(0, t_f, (outs * w_f[:, None]).to(h.dtype))
        y = torch.zeros_like(flat).index_copy(0, tok_ids, y_tok)
        aux = self.n_exp * (F.one_hot(e[:, 0], self.n_exp).float().mean(0) * probs.mean(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        return y.view(B, T, D), aux, z


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, moe, n_exp, cf):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.moe = moe
        self.ffn = Top2FFN(dim, n_exp, cf) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, attn_mask):
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, key_padding_mask=~attn_mask, need_weights=False)[0])
        if self.moe:
            y, aux, z = self.ffn(self.ln2(x), attn_mask)
        else:
            y, aux, z = self.ffn(self.ln2(x)), None, None
        return x + self.drop(y), aux, z


class MoEClassifier(nn.Module):
    def __init__(self, vocab, n_classes, a):
        super().__init__()
        self.tok = nn.Embedding(vocab, a.dim, padding_idx=0)
        self.pos = nn.Embedding(a.max_len, a.dim)
        self.layers = nn.ModuleList(EncoderLayer(a.dim, a.heads, i % 2 == 1, a.experts, a.cf) for i in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.cls = nn.Linear(a.dim, n_classes)

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        aux, z = [], []
        for layer in self.layers:
            x, a_, z_ = layer(x, mask)
            if a_ is not None:
                aux.append(a_)
                z.append(z_)
        pooled = (self.norm(x) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.cls(pooled), torch.stack(aux).mean(), torch.stack(z).mean()


def make_collate(tok, max_len):
    def collate(rows):
        enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"].bool(), torch.tensor([r["label"] for r in rows])
    return collate


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for ids, mask, y in loader:
        ids, mask, y = ids.to(device), mask.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _, _ = net(ids, mask)
        s[0] += (logits.argmax(-1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # rank 0 downloads / prepares the HF caches first, the others then read them
    if rank != 0:
        dist.barrier()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    ds = load_dataset("ag_news")
    if rank == 0:
        dist.barrier()

    split = ds["train"].train_test_split(test_size=5000, seed=0)
    train_ds, dev_ds, test_ds = split["train"], split["test"], ds["test"]
    collate = make_collate(tok, a.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, a.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)
    dev_dl = DataLoader(dev_ds, 256, sampler=DistributedSampler(dev_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)
    test_dl = DataLoader(test_ds, 256, sampler=DistributedSampler(test_ds, shuffle=False), collate_fn=collate,
                         num_workers=2)

    torch.manual_seed(0)
    net = MoEClassifier(tok.vocab_size, 4, a).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=total, pct_start=0.06)

    os.makedirs(a.out, exist_ok=True)
    last_path, best_path = os.path.join(a.out, "last.pt"), os.path.join(a.out, "best.pt")
    start_epoch, best = 0, 0.0
    if a.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    model = DDP(net, device_ids=[local_rank])

    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, z = model(ids, mask)
                loss = F.cross_entropy(logits, y) + a.aux * aux + a.zloss * z
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if i % 200 == 0 and rank == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} aux {aux.item():.4f}", flush=True)

        dev_acc = evaluate(model, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch} dev acc {dev_acc * 100:.2f} ({time.time() - t0:.0f}s)", flush=True)
            is_best = dev_acc > best
            best = max(best, dev_acc)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, last_path)
            if is_best:
                torch.save(state, best_path)
        dist.barrier()

    # score the best checkpoint on the test split
    ck = torch.load(best_path, map_location=device)
    net.load_state_dict(ck["model"])
    test_acc = evaluate(net, test_dl, device)
    if rank == 0:
        print(f"best dev {ck['best'] * 100:.2f}  test acc {test_acc * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
