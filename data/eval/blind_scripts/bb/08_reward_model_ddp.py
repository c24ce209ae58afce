"""Pairwise (Bradley-Terry) reward model on Anthropic HH, torchrun + DDP.

A scalar value head sits on the last hidden state of the final non-pad token.

    torchrun --nproc_per_node=8 08_reward_model_ddp.py --base EleutherAI/pythia-1.4b-deduped --out rm/pythia-1.4b-hh
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


class RewardModel(nn.Module):
    def __init__(self, base_name):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(base_name, torch_dtype=torch.float32)
        hidden = self.lm.config.hidden_size
        self.v_head = nn.Linear(hidden, 1, bias=False)
        nn.init.normal_(self.v_head.weight, std=1.0 / (hidden + 1))

    def forward(self, input_ids, attention_mask):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        h = out.hidden_states[-1]
        last = attention_mask.sum(dim=1) - 1
        h_last = h[torch.arange(h.size(0), device=h.device), last]
        return self.v_head(h_last).squeeze(-1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="EleutherAI/pythia-1.4b-deduped")
    ap.add_argument("--out", default="rm/out")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def tokenize_pair(ex, tok, max_len):
    c = tok(ex["chosen"], truncation=True, max_length=max_len)
    r = tok(ex["rejected"], truncation=True, max_length=max_len)
    return {"c_ids": c["input_ids"], "r_ids": r["input_ids"]}


def pair_collate(batch, pad_id):
    seqs = [b["c_ids"] for b in batch] + [b["r_ids"] for b in batch]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def pair_loss(model, ids, mask):
    rewards = model(ids, mask)
    n = rewards.size(0) // 2
    chosen, rejected = rewards[:n], rewards[n:]
    loss = -F.logsigmoid(chosen - rejected).mean()
    acc = (chosen > rejected).float().mean()
    return loss, acc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    for ids, mask in loader:
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, acc = pair_loss(model, ids, mask)
        n = ids.size(0) // 2
        totals += torch.tensor([loss.item() * n, acc.item() * n, n], device=device)
    dist.all_reduce(totals)
    model.train()
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.eos_token
    tok.padding_side = "right"

    if rank != 0:
        dist.barrier()
    ds = load_dataset("Anthropic/hh-rlhf")
    ds = ds.map(tokenize_pair, fn_kwargs={"tok": tok, "max_len": args.max_len},
                remove_columns=ds["train"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()

    collate = lambda b: pair_collate(b, tok.pad_token_id)  # noqa: E731
    tr_sampler = DistributedSampler(ds["train"], shuffle=True, seed=args.seed)
    te_sampler = DistributedSampler(ds["test"], shuffle=False, drop_last=True)
    train_dl = DataLoader(ds["train"], batch_size=args.bsz, sampler=tr_sampler, collate_fn=collate,
                          num_workers=4, drop_last=True)
    test_dl = DataLoader(ds["test"], batch_size=args.bsz, sampler=te_sampler, collate_fn=collate, num_workers=2)

    model = RewardModel(args.base)
    model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.lm.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, best_acc = 0, 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for ids, mask in train_dl:
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, acc = pair_loss(model, ids, mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                t = torch.stack([loss.detach().float(), acc.detach()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {t[0]:.4f} acc {t[1]:.3f}", flush=True)

            if step % args.eval_every == 0 or step == total:
                eval_loss, eval_acc = evaluate(model, test_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {eval_loss:.4f} acc {eval_acc:.4f}", flush=True)
                    if eval_acc > best_acc:
                        best_acc = eval_acc
                        inner = model.module
                        inner.lm.save_pretrained(os.path.join(args.out, "best", "lm"))
                        torch.save(inner.v_head.state_dict(), os.path.join(args.out, "best", "v_head.pt"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                        with open(os.path.join(args.out, "best", "metrics.json"), "w") as f:
                            json.dump({"step": step, "eval_loss": eval_loss, "eval_acc": eval_acc}, f)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
