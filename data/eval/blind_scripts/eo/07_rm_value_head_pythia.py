#!/usr/bin/env python
# Reward model = SFT causal LM + scalar value head on the last response token.
# We start from the SFT checkpoint (not a fresh classifier) so the RM shares the policy's tokenizer
# and chat format; the value head is zero-initialised.
#
#   torchrun --nproc_per_node=8 07_rm_value_head_pythia.py --sft ckpts/pythia-2.8b-sft-tldr \
#       --train data/tldr_prefs_train.jsonl --valid data/tldr_prefs_valid.jsonl --save_dir runs/rm-2.8b
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
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


class RewardModel(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        hidden = self.lm.config.hidden_size
        self.v_head = nn.Linear(hidden, 1, bias=False)
        nn.init.zeros_(self.v_head.weight)

    def forward(self, input_ids, attention_mask):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        h = out.hidden_states[-1]
        # right padded: index of the last real token in each row
        last = attention_mask.sum(dim=1) - 1
        h_last = h[torch.arange(h.size(0), device=h.device), last]
        return self.v_head(h_last).squeeze(-1)


class TLDRPrefs(Dataset):
    """jsonl rows with 'post', 'chosen' and 'rejected' summaries."""

    TEMPLATE = "SUBREDDIT: r/{subreddit}\nTITLE: {title}\nPOST: {post}\nTL;DR:"

    def __init__(self, path, tok, max_len=640):
        self.rows = [json.loads(l) for l in open(path, encoding="utf-8")]
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def encode(self, prompt, summary):
        p = self.tok(prompt)["input_ids"]
        s = self.tok(" " + summary.strip())["input_ids"] + [self.tok.eos_token_id]
        p = p[-(self.max_len - len(s)):] if len(p) + len(s) > self.max_len else p
        return (p + s)[-self.max_len:]

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = self.TEMPLATE.format(subreddit=r["subreddit"], title=r["title"], post=r["post"])
        return self.encode(prompt, r["chosen"]), self.encode(prompt, r["rejected"])


def pad_pairs(batch, pad_id):
    seqs = [c for c, _ in batch] + [r for _, r in batch]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


class PairPad:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return pad_pairs(batch, self.pad_id)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc_sum = torch.zeros(3, device=device)  # correct, count, sum of margins
    for ids, mask in loader:
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            r = model(ids, mask).float()
        n = r.numel() // 2
        acc_sum[0] += (r[:n] > r[n:]).sum()
        acc_sum[1] += n
        acc_sum[2] += (r[:n] - r[n:]).sum()
    dist.all_reduce(acc_sum)
    model.train()
    return (acc_sum[0] / acc_sum[1]).item(), (acc_sum[2] / acc_sum[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup_frac", type=float, default=0.05)
    ap.add_argument("--valid_every", type=int, default=300)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.sft)
    tok.pad_token = tok.eos_token

    train = TLDRPrefs(args.train, tok)
    valid = TLDRPrefs(args.valid, tok)
    tr_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(valid, shuffle=False, drop_last=True)
    collate = PairPad(tok.pad_token_id)
    tr_loader = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=4)
    va_loader = DataLoader(valid, batch_size=args.bs, sampler=va_sampler, collate_fn=collate, num_workers=4)

    rm = RewardModel(args.sft).to(device)
    rm.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rm.lm.config.use_cache = False
    model = DDP(rm, device_ids=[local_rank], output_device=local_rank)

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, eps=1e-6)
    total = len(tr_loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, math.ceil(args.warmup_frac * total), total)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = -1.0
    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for ids, mask in tr_loader:
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                r = model(ids, mask).float()
            n = r.numel() // 2
            loss = -F.logsigmoid(r[:n] - r[n:]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                t = torch.stack([loss.detach(), (r[:n] > r[n:]).float().mean().detach()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {t[0]:.4f} acc {t[1]:.3f} lr {sched.get_last_lr()[0]:.2e}",
                          flush=True)

            if step % args.valid_every == 0 or step == total:
                acc, margin = validate(model, va_loader, device)
                if rank == 0:
                    print(f"[valid] step {step} acc {acc:.4f} margin {margin:.3f}", flush=True)
                    if acc > best:
                        best = acc
                        torch.save(model.module.state_dict(), os.path.join(args.save_dir, "rm_best.pt"))
                        tok.save_pretrained(args.save_dir)
                dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.save_dir, "rm_last.pt"))
        print(f"done, best valid acc {best:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
