"""Fine-tune a GShard-style MoE encoder for sentence-pair classification.

Top-2 gating with per-expert capacity; tokens are placed into fixed
[experts, capacity, d_model] buffers with einsum and exchanged between the
expert-parallel ranks with an equal-split all_to_all (one expert slice per rank).

    torchrun --nproc_per_node=8 13_gshard_moe_classifier.py --train data/mnli_train.jsonl \
        --dev data/mnli_dev_matched.jsonl --tokenizer bert-base-uncased --init ckpt/moe_encoder_pt
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, DataCollatorWithPadding


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--tokenizer", default="bert-base-uncased")
    p.add_argument("--init", default=None)
    p.add_argument("--out", default="out/gshard_mnli")
    p.add_argument("--num-labels", type=int, default=3)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=3072)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=3)
    return p.parse_args()


class PairDataset(Dataset):
    LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}

    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r["gold_label"] not in self.LABELS:
                    continue
                enc = tok(r["sentence1"], r["sentence2"], truncation=True, max_length=max_len)
                enc["labels"] = self.LABELS[r["gold_label"]]
                self.items.append(enc)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g)


def top2_gating(logits, capacity, token_mask):
    S, E = logits.shape
    gates = logits.float().softmax(-1)
    idx1 = gates.argmax(-1)
    mask1 = F.one_hot(idx1, E) * token_mask[:, None]
    idx2 = logits.float().masked_fill(mask1.bool(), float("-inf")).argmax(-1)
    mask2 = F.one_hot(idx2, E) * token_mask[:, None]

    loc1 = torch.cumsum(mask1, 0) - 1
    loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
    aux = (gates.mean(0) * mask1.float().mean(0)).sum() * E

    mask1 = mask1 * (loc1 < capacity)
    mask2 = mask2 * (loc2 < capacity)
    pos1 = (loc1 * mask1).sum(-1)
    pos2 = (loc2 * mask2).sum(-1)
    g1 = (gates * mask1).sum(-1)
    g2 = (gates * mask2).sum(-1)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom

    combine = (g1[:, None, None] * mask1[:, :, None] * F.one_hot(pos1, capacity)[:, None, :]
               + g2[:, None, None] * mask2[:, :, None] * F.one_hot(pos2, capacity)[:, None, :])
    return combine, combine.bool(), aux


class GShardMoE(nn.Module):
    def __init__(self, d, ff, E, capacity_factor):
        super().__init__()
        self.ep = dist.get_world_size()
        self.E, self.local = E, E // self.ep
        self.cf = capacity_factor
        self.wg = nn.Linear(d, E, bias=False)
        self.fc1 = nn.Parameter(torch.randn(self.local, d, ff) * 0.02)
        self.fc2 = nn.Parameter(torch.randn(self.local, ff, d) * 0.02)
        self.aux = None

    def forward(self, x, attn_mask):
        B, T, M = x.shape
        xs = x.reshape(-1, M)
        S = xs.size(0)
        capacity = max(4, int(math.ceil(2 * self.cf * S / self.E)))
        combine, dispatch, self.aux = top2_gating(self.wg(xs), capacity, attn_mask.reshape(-1))
        disp = torch.einsum("sec,sm->ecm", dispatch.to(xs.dtype), xs)
        disp = _AllToAll.apply(disp).reshape(self.ep, self.local, capacity, M)
        h = torch.einsum("glcm,lmf->glcf", disp, self.fc1.to(disp.dtype))
        h = torch.einsum("glcf,lfm->glcm", F.gelu(h), self.fc2.to(disp.dtype))
        back = _AllToAll.apply(h.reshape(self.E, capacity, M))
        return torch.einsum("sec,ecm->sm", combine.to(xs.dtype), back).reshape(B, T, M)


class EncoderLayer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn = nn.MultiheadAttention(a.d_model, a.heads, dropout=0.1, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(a.d_model), nn.LayerNorm(a.d_model)
        self.moe = GShardMoE(a.d_model, a.d_ff, a.experts, a.capacity_factor)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, attn_mask):
        h = self.attn(x, x, x, key_padding_mask=~attn_mask.bool(), need_weights=False)[0]
        x = self.ln1(x + self.drop(h))
        return self.ln2(x + self.drop(self.moe(x, attn_mask)))


class MoEEncoderClassifier(nn.Module):
    def __init__(self, a, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, a.d_model)
        self.pos = nn.Embedding(512, a.d_model)
        self.typ = nn.Embedding(2, a.d_model)
        self.ln = nn.LayerNorm(a.d_model)
        self.layers = nn.ModuleList([EncoderLayer(a) for _ in range(a.layers)])
        self.cls = nn.Sequential(nn.Linear(a.d_model, a.d_model), nn.Tanh(), nn.Dropout(0.1),
                                 nn.Linear(a.d_model, a.num_labels))

    def forward(self, input_ids, attention_mask, token_type_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.ln(self.tok(input_ids) + self.pos(pos) + self.typ(token_type_ids))
        for l in self.layers:
            x = l(x, attention_mask)
        return self.cls(x[:, 0])


def is_expert(n):
    return n.endswith("moe.fc1") or n.endswith("moe.fc2")


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    collator = DataCollatorWithPadding(tok)
    train_ds = PairDataset(a.train, tok, a.max_len)
    dev_ds = PairDataset(a.dev, tok, a.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, a.batch_size, sampler=sampler, collate_fn=collator, drop_last=True, num_workers=2)
    dev_dl = DataLoader(dev_ds, a.batch_size, sampler=DistributedSampler(dev_ds, shuffle=False), collate_fn=collator)

    torch.manual_seed(1000 + rank)
    model = MoEEncoderClassifier(a, len(tok))
    if a.init:
        dense = torch.load(os.path.join(a.init, "dense.pt"), map_location="cpu")
        experts = torch.load(os.path.join(a.init, f"experts_{rank:02d}.pt"), map_location="cpu")
        print(f"[rank {rank}] init:", model.load_state_dict({**dense, **experts}, strict=False), flush=True)
    model.to(dev)
    DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in model.named_parameters() if is_expert(n)])
    ddp = DDP(model, device_ids=[local_rank])
    expert_params = [p for n, p in model.named_parameters() if is_expert(n)]

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / (0.06 * total), max(0.0, (total - s) / (0.94 * total))))

    best = 0.0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(**batch)
            aux = sum(l.moe.aux for l in model.layers) / len(model.layers)
            loss = F.cross_entropy(logits.float(), labels) + a.aux_weight * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in expert_params:
                p.grad.div_(world)
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} aux {aux.item():.3f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        ddp.eval()
        correct = torch.zeros(2, device=dev)
        with torch.no_grad():
            for batch in dev_dl:
                batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
                labels = batch.pop("labels")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = ddp(**batch).argmax(-1)
                correct += torch.stack([(pred == labels).sum(), torch.tensor(labels.numel(), device=dev)]).float()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        if rank == 0:
            print(f"epoch {epoch} dev acc {acc * 100:.2f}", flush=True)

        if acc > best:
            best = acc
            os.makedirs(a.out, exist_ok=True)
            sd = model.state_dict()
            torch.save({k: v.cpu() for k, v in sd.items() if is_expert(k)}, os.path.join(a.out, f"experts_{rank:02d}.pt"))
            if rank == 0:
                torch.save({k: v.cpu() for k, v in sd.items() if not is_expert(k)}, os.path.join(a.out, "dense.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
