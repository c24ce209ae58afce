#!/usr/bin/env python
"""ORPO (odds-ratio preference optimisation): SFT + preference in one stage, no reference model.

    torchrun --nproc_per_node=8 20_orpo_eval_stats.py --model HuggingFaceTB/SmolLM2-1.7B \
        --train data/orpo_mix_train.jsonl --eval data/orpo_mix_eval.jsonl --out runs/orpo-smol
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

IGNORE = -100


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lam", type=float, default=0.1, help="weight of the odds-ratio term")
    ap.add_argument("--lr", type=float, default=8e-6)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--eval_every", type=int, default=300)
    return ap.parse_args()


class ORPOData(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = []
        for line in open(path):
            r = json.loads(line)
            p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                        add_generation_prompt=True)[-max_prompt_len:]
            c = tok(r["chosen"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            j = tok(r["rejected"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            self.rows.append((p, c[: max_len - len(p)], j[: max_len - len(p)]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            lab[i, len(p): len(p) + len(r)] = torch.tensor(r)
            att[i, : len(p) + len(r)] = 1
        return ids, att, lab


def orpo_terms(model, ids, att, lab):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = (tgt != IGNORE).float()
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    avg = (lp * m).sum(-1) / m.sum(-1).clamp(min=1)
    n = avg.shape[0] // 2
    c, r = avg[:n], avg[n:]
    nll = -c.mean()
    # log odds(y|x) = log p - log(1 - p), with p the per-token geometric mean probability
    log_odds = (c - r) - (torch.log1p(-torch.exp(c).clamp(max=1 - 1e-6)) - torch.log1p(-torch.exp(r).clamp(max=1 - 1e-6)))
    or_loss = -F.logsigmoid(log_odds).mean()
    return nll, or_loss, log_odds.detach(), c.detach(), r.detach()


@torch.no_grad()
def evaluate(model, loader, device, lam):
    model.eval()
    nll_sum, or_sum, correct, margin_sum, count = 0.0, 0.0, 0, 0.0, 0
    for ids, att, lab in loader:
        nll, or_loss, log_odds, c, r = orpo_terms(model, ids.to(device), att.to(device), lab.to(device))
        n = c.numel()
        nll_sum += nll.item() * n
        or_sum += or_loss.item() * n
        correct += (log_odds > 0).sum().item()
        margin_sum += (c - r).sum().item()
        count += n
    totals = torch.tensor([nll_sum, or_sum, correct, margin_sum, count], dtype=torch.float64)
    dist.all_reduce(totals)
    model.train()
    nll_sum, or_sum, correct, margin_sum, count = totals.tolist()
    return {"eval_nll": nll_sum / count, "eval_or_loss": or_sum / count, "eval_loss": (nll_sum + lam * or_sum) / count,
            "eval_pref_acc": correct / count, "eval_logp_margin": margin_sum / count}


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.chat_template is None:
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    train = ORPOData(args.train, tok, args.max_len, args.max_prompt_len)
    evals = ORPOData(args.eval, tok, args.max_len, args.max_prompt_len)
    collate = Collate(tok.pad_token_id)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    ev_sampler = DistributedSampler(evals, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=4,
                       pin_memory=True)
    ev_dl = DataLoader(evals, batch_size=args.bs, sampler=ev_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = (len(tr_dl) // args.accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, updates)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train)} train / {len(evals)} eval pairs, {updates} updates", flush=True)

    upd, t0 = 0, time.time()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for it, (ids, att, lab) in enumerate(tr_dl):
            if it >= (len(tr_dl) // args.accum) * args.accum:
                break
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            last = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                nll, or_loss, log_odds, c, r = orpo_terms(model, ids, att, lab)
                loss = nll + args.lam * or_loss
                (loss / args.accum).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1

            if upd % 10 == 0:
                s = torch.stack([nll.detach(), or_loss.detach(), (log_odds > 0).float().mean(), log_odds.mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} upd {upd}/{updates} nll {s[0]:.4f} or {s[1]:.4f} acc {s[2]:.3f} "
                          f"log_odds {s[3]:.3f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

            if upd % args.eval_every == 0:
                metrics = evaluate(model, ev_dl, device, args.lam)
                if rank == 0:
                    print(json.dumps({"upd": upd, **metrics}), flush=True)

        if rank == 0:
            d = os.path.join(args.out, f"epoch{epoch}")
            model.module.save_pretrained(d)
            tok.save_pretrained(d)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
