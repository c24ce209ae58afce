"""FSDP reward model training (Llama-3.2-3B base, full shard, bf16).

torchrun --nnodes 1 --nproc_per_node 8 11_rm_fsdp_llama.py \
    --model meta-llama/Llama-3.2-3B --train_jsonl data/skywork_pref/train.jsonl \
    --eval_jsonl data/skywork_pref/eval.jsonl --save_dir /checkpoint/rm_llama32_3b
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class PrefData(Dataset):
    def __init__(self, path, tok, max_len):
        self.tok, self.max_len = tok, max_len
        with open(path) as f:
            self.rows = [json.loads(x) for x in f]

    def __len__(self):
        return len(self.rows)

    def _enc(self, conv):
        ids = self.tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=False)
        return ids[: self.max_len]

    def __getitem__(self, i):
        r = self.rows[i]
        return self._enc(r["chosen"]), self._enc(r["rejected"])


def collate_pairs(batch, pad_id):
    seqs = [c for c, _ in batch] + [r for _, r in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    am = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
    return ids, am


class RM(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name, torch_dtype=torch.bfloat16)
        self.score = nn.Linear(self.backbone.config.hidden_size, 1, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(self.score.weight, std=1.0 / (self.backbone.config.hidden_size + 1) ** 0.5)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(-1) - 1
        return self.score(h[torch.arange(h.size(0), device=h.device), last]).squeeze(-1).float()


def save_model(model, tok, out_dir):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    os.makedirs(out_dir, exist_ok=True)
    torch.save(state, os.path.join(out_dir, "rm_state_dict.pt"))
    tok.save_pretrained(out_dir)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stat = torch.zeros(3, device=device)
    for ids, am in loader:
        r = model(ids.to(device), am.to(device))
        rc, rr = r.chunk(2)
        stat[0] += (rc > rr).sum()
        stat[1] += rc.numel()
        stat[2] += -F.logsigmoid(rc - rr).sum()
    dist.all_reduce(stat)
    model.train()
    return (stat[0] / stat[1]).item(), (stat[2] / stat[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train_jsonl", required=True)
    ap.add_argument("--eval_jsonl", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bsz", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=250)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.cuda.current_device()
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = "<|end_of_text|>"
    train_ds = PrefData(args.train_jsonl, tok, args.max_len)
    eval_ds = PrefData(args.eval_jsonl, tok, args.max_len)
    col = functools.partial(collate_pairs, pad_id=tok.pad_token_id)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    ev_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bsz, sampler=tr_sampler, collate_fn=col,
                          num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.bsz, sampler=ev_sampler, collate_fn=col, drop_last=True)

    model = RM(args.model)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = len(train_dl) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.03,
                                                anneal_strategy="cos")
    if rank == 0:
        print(f"FSDP on {world} ranks; {len(train_ds)} train pairs; {total} steps", flush=True)

    best = 0.0
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for ids, am in train_dl:
            ids, am = ids.to(device, non_blocking=True), am.to(device, non_blocking=True)
            r = model(ids, am)
            rc, rr = r.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f} gnorm {gn.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

            if step % args.eval_every == 0 or step == total:
                acc, eval_loss = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"eval step {step}: acc {acc:.4f} loss {eval_loss:.4f}", flush=True)
                    if acc > best:
                        best = acc
                        save_model(model, tok, os.path.join(args.save_dir, "best"))
                dist.barrier()

    dist.barrier()
    if rank == 0:
        print(f"best eval accuracy {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
