"""Supervised fine-tuning of a pretrained expert-parallel MoE LM on chat data.

Expert layout matches pretraining: world_size ranks, num_experts / world_size
experts per rank, dropless top-2 routing with all_to_all_single. Dense weights
are data-parallel (DDP); expert weights are excluded from DDP.

    torchrun --nproc_per_node=8 08_moe_chat_sft.py \
        --init-from /ckpt/moe_1b_pretrain/step_200000 --tokenizer /ckpt/moe_1b_pretrain/tokenizer \
        --train-file data/sft_train.jsonl --val-file data/sft_val.jsonl
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
from transformers import AutoTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-from", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--val-file", required=True)
    ap.add_argument("--output-dir", default="out/moe_sft")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--aux-coef", type=float, default=1e-3)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--n-layers", type=int, default=16)
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--num-experts", type=int, default=32)
    return ap.parse_args()


class ChatDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids, labels = [self.tok.bos_token_id], [-100]
        for turn in self.rows[i]["messages"]:
            tag = "<|user|>" if turn["role"] == "user" else "<|assistant|>"
            piece = self.tok.encode(tag + turn["content"], add_special_tokens=False)
            ids += piece
            labels += piece if turn["role"] == "assistant" else [-100] * len(piece)
        ids, labels = ids[: self.max_len], labels[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    n = max(x.size(0) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : x.size(0)], lab[i, : y.size(0)] = x, y
    return ids, lab


class A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        y = x.new_empty(sum(out_splits), x.size(-1))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits)
        return y

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return A2A.apply(g, in_splits, out_splits), None, None


class Top2MoE(nn.Module):
    def __init__(self, d, ff, E):
        super().__init__()
        self.ep = dist.get_world_size()
        self.E, self.L = E, E // self.ep
        self.gate = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(self.L, d, ff).normal_(0, 0.02))
        self.w2 = nn.Parameter(torch.empty(self.L, ff, d).normal_(0, 0.02))
        self.aux = None

    def forward(self, x):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        probs = self.gate(x).float().softmax(-1)
        w, e = probs.topk(2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        self.aux = self.E * (F.one_hot(e, self.E).float().sum(1).mean(0) / 2 * probs.mean(0)).sum()

        flat_e = e.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tok_idx = order // 2
        counts = torch.bincount(flat_e, minlength=self.E)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        in_splits = counts.view(self.ep, self.L).sum(1).tolist()
        out_splits = recv_counts.view(self.ep, self.L).sum(1).tolist()

        h = A2A.apply(x[tok_idx], out_splits, in_splits)
        rc = recv_counts.view(self.ep, self.L)
        pieces = h.split(rc.flatten().tolist())
        outs = [None] * len(pieces)
        for j in range(self.L):
            ids = [s * self.L + j for s in range(self.ep)]
            inp = torch.cat([pieces[i] for i in ids])
            o = F.silu(inp @ self.w1[j].to(inp.dtype)) @ self.w2[j].to(inp.dtype)
            for i, part in zip(ids, o.split(rc[:, j].tolist())):
                outs[i] = part
        y = A2A.apply(torch.cat(outs), in_splits, out_splits)
        y = y * w.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add(0, tok_idx, y.to(x.dtype)).view(shp)


class Layer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h = a.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(a.d_model), nn.LayerNorm(a.d_model)
        self.qkv = nn.Linear(a.d_model, 3 * a.d_model, bias=False)
        self.o = nn.Linear(a.d_model, a.d_model, bias=False)
        self.moe = Top2MoE(a.d_model, a.d_ff, a.num_experts)

    def forward(self, x, pad_mask):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & pad_mask[:, None, None, :]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, D))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, a, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, a.d_model)
        self.rope_free_pos = nn.Embedding(a.max_len, a.d_model)
        self.layers = nn.ModuleList([Layer(a) for _ in range(a.n_layers)])
        self.norm = nn.LayerNorm(a.d_model)
        self.lm_head = nn.Linear(a.d_model, vocab_size, bias=False)

    def resize_token_embeddings(self, n):
        old_e, old_h = self.embed.weight.data, self.lm_head.weight.data
        self.embed = nn.Embedding(n, old_e.size(1))
        self.lm_head = nn.Linear(old_e.size(1), n, bias=False)
        mean_e, mean_h = old_e.mean(0), old_h.mean(0)
        self.embed.weight.data[: old_e.size(0)] = old_e
        self.embed.weight.data[old_e.size(0):] = mean_e
        self.lm_head.weight.data[: old_h.size(0)] = old_h
        self.lm_head.weight.data[old_h.size(0):] = mean_h

    def forward(self, ids, pad_mask):
        x = self.embed(ids) + self.rope_free_pos(torch.arange(ids.size(1), device=ids.device))
        for l in self.layers:
            x = l(x, pad_mask)
        return self.lm_head(self.norm(x))


def is_expert(name):
    return name.endswith(".moe.w1") or name.endswith(".moe.w2")


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    if rank == 0:
        tok.add_special_tokens({"pad_token": "<|pad|>", "additional_special_tokens": ["<|user|>", "<|assistant|>"]})
        os.makedirs(a.output_dir, exist_ok=True)
        tok.save_pretrained(a.output_dir)
    dist.barrier()

    dense = torch.load(os.path.join(a.init_from, "dense.pt"), map_location="cpu")
    experts = torch.load(os.path.join(a.init_from, f"experts_rank{rank:03d}.pt"), map_location="cpu")
    model = MoELM(a, vocab_size=dense["embed.weight"].size(0))
    model.load_state_dict({**dense, **experts})
    if len(tok) != model.embed.num_embeddings:
        model.resize_token_embeddings(len(tok))
    model.to(device)

    DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in model.named_parameters() if is_expert(n)])
    ddp = DDP(model, device_ids=[local_rank])
    expert_params = [p for n, p in model.named_parameters() if is_expert(n)]

    train_ds = ChatDataset(a.train_file, tok, a.max_len)
    val_ds = ChatDataset(a.val_file, tok, a.max_len)
    coll = lambda b: collate(b, tok.pad_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, a.batch_size, sampler=sampler, collate_fn=coll, num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, a.batch_size, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=coll)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    total = a.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 100) * 0.5 * (1 + math.cos(math.pi * s / total)))

    def run_loss(ids, lab):
        ids, lab = ids.to(device), lab.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = ddp(ids, ids != tok.pad_token_id)
        ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), lab[:, 1:].flatten(), ignore_index=-100)
        aux = sum(l.moe.aux for l in model.layers) / len(model.layers)
        return ce, aux

    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for ids, lab in train_dl:
            ce, aux = run_loss(ids, lab)
            opt.zero_grad(set_to_none=True)
            (ce + a.aux_coef * aux).backward()
            for p in expert_params:
                p.grad.div_(world)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"ep {epoch} step {step}/{total} ce {ce.item():.4f} aux {aux.item():.3f}", flush=True)

        ddp.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, lab in val_dl:
                ce, _ = run_loss(ids, lab)
                acc += torch.stack([ce.float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val ce {(acc[0] / acc[1]).item():.4f}", flush=True)

        save_dir = os.path.join(a.output_dir, f"epoch{epoch}")
        os.makedirs(save_dir, exist_ok=True)
        sd = {k: v.cpu() for k, v in model.state_dict().items()}
        torch.save({k: v for k, v in sd.items() if is_expert(k)}, os.path.join(save_dir, f"experts_rank{rank:03d}.pt"))
        if rank == 0:
            torch.save({k: v for k, v in sd.items() if not is_expert(k)}, os.path.join(save_dir, "dense.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
